"""Once started, the server lets go of the library pages only startup touched: the clean pages of
private read-only file mappings, never a mapping with a page the process wrote (a relocated constant),
a writable one or a shared one. Whatever is touched again works as before."""

import subprocess
import sys

from kvserve.model.heap import clean_file_mappings

SMAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 11 /usr/lib/libx.so
Rss:                   4 kB
Anonymous:             0 kB
7f0000001000-7f0000003000 r-xp 00001000 08:01 11 /usr/lib/libx.so
Rss:                   8 kB
Anonymous:             0 kB
7f0000003000-7f0000004000 r--p 00003000 08:01 11 /usr/lib/libx.so
Rss:                   4 kB
Anonymous:             4 kB
7f0000004000-7f0000005000 rw-p 00004000 08:01 11 /usr/lib/libx.so
Rss:                   4 kB
Anonymous:             0 kB
7f0000005000-7f0000006000 r--s 00000000 08:01 12 /dev/shm/shared
Anonymous:             0 kB
7f0000006000-7f0000007000 r--p 00000000 00:00 0
Anonymous:             0 kB
7f0000007000-7f0000008000 r-xp 00000000 00:00 0 [vdso]
Anonymous:             0 kB
7f0000008000-7f000000a000 r--p 00000000 08:01 13 /models/model.safetensors
Anonymous:             0 kB
"""


def test_only_clean_private_read_only_file_mappings_are_released() -> None:
    assert clean_file_mappings(SMAPS) == [
        (0x7F0000000000, 0x7F0000001000),
        (0x7F0000001000, 0x7F0000003000),
        (0x7F0000008000, 0x7F000000A000),
    ]


def test_a_process_computes_the_same_after_releasing_its_startup_pages() -> None:
    code = (
        "import torch\n"
        "from kvserve.model.heap import release_startup_pages\n"
        "x = torch.arange(64, dtype=torch.float32).reshape(8, 8)\n"
        "before = (x @ x.T).softmax(-1)\n"
        "released = release_startup_pages()\n"
        "after = (x @ x.T).softmax(-1)\n"
        "print(released > 0, torch.equal(before, after))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
