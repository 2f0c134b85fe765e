"""The supported model families, one module each; this registry finds a config's or a GGUF's family.

Adding a family: one module declaring a `Family` (see base.py), listed in FAMILIES, plus its tests.
"""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family
from kvserve.model.families.gemma3 import GEMMA3
from kvserve.model.families.gpt_oss import GPT_OSS
from kvserve.model.families.lfm2 import LFM2
from kvserve.model.families.llama import LLAMA, MISTRAL
from kvserve.model.families.phi3 import PHI3
from kvserve.model.families.qwen2 import QWEN2
from kvserve.model.families.qwen3 import QWEN3
from kvserve.model.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from kvserve.model.families.qwen3_moe import QWEN3_MOE
from kvserve.model.families.qwen3_next import QWEN3_NEXT
from kvserve.model.families.smollm3 import SMOLLM3
from kvserve.model.spec import ModelConfig

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    SMOLLM3,
    PHI3,
    GEMMA3,
    LFM2,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
    GPT_OSS,
)


def family_named(name: str) -> Family:
    """The family whose ModelConfig.architecture is `name`."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}")


def family_for_gguf(architecture: str) -> Family:
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    supported = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {supported}")


def config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json; raises ValueError naming what is missing or wrong."""
    architectures = raw.get("architectures") or []
    by_name = {a: f for f in FAMILIES for a in f.hf_architectures}
    family = next((by_name[a] for a in architectures if a in by_name), None)
    if family is None:
        supported = ", ".join(sorted(by_name))
        raise ValueError(f"unsupported architecture {architectures or 'none given'}; supported: {supported}")
    try:
        return family.config(raw)
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None
    except TypeError as e:
        raise ValueError(f"config.json has a field of the wrong type ({e})") from None
