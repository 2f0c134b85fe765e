"""Grammars written to make the grammar library work hard: shared by the engine's, the server's and the
fuzzing tests, and the flood measurement."""

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def overlapping_terminals(count: int = 60, width: int = 6, salt: str = "") -> str:
    """A Lark grammar of `count` regex terminals that all overlap (`/[a-z]*x[a-z]{w}/`): the lexer's
    states multiply with every letter, as in the review's 2.5 KB grammar that reached 250,000 states.
    `salt` (letters) names the terminals apart, so that two grammars of one shape are two sources."""
    names = [f"T{salt.upper()}_{i}" for i in range(count)]
    terminals = [
        f"{name}: /[a-z]*{_LETTERS[i % 26]}[a-z]{{{width + i % 4}}}/" for i, name in enumerate(names)
    ]
    start = "start: (" + " | ".join(names) + ")+"
    return "\n".join([start, *terminals]) + "\n"


def huge_alternation(count: int, salt: str = "") -> str:
    """A start rule of `count` literal alternatives sharing long prefixes."""
    return "start: " + " | ".join(f'"{salt}option-{i:06d}-{i * 7919 % 10007}"' for i in range(count)) + "\n"


def deep_nesting(depth: int, salt: str = "") -> str:
    """Rules nested `depth` deep, each wrapping the next in brackets or ending."""
    rules = [f'r{i}: "(" r{i + 1} ")" | "{salt}x"' for i in range(depth)]
    rules.append(f'r{depth}: "{salt}y"')
    return "start: r0\n" + "\n".join(rules) + "\n"
