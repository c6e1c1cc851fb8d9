"""A synthetic corpus where depth pays: chained variable assignments, generated from a seed (issue 32).

On 0.3 M parameters and a byte corpus extra depth does not lower the loss, which every reproduced paper
presupposes; here the number of sequential lookups each token needs is known per token (``a7,ba;?b7?a7``).
The difficulty is not carried from the generator: :func:`difficulty` recomputes it from the text alone (a
reference solver), so anyone can check a prepared dataset's labels.
docs/data.md, "Synthetic data: a corpus where depth pays" (format, difficulty rule, settings, why this shape).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import numpy as np

from elastic_pretrain.config import ConfigError
from elastic_pretrain.data.config import MAX_DIFFICULTY, NAMES, PAD, VALUES, SyntheticConfig
from elastic_pretrain.errors import UserError

ORDINARY = 0  # difficulty of a token that is not an answer


@dataclasses.dataclass(frozen=True)
class Line:
    """One generated line and, per variable, its value and depth, and per asked variable the lookups its
    answer needs given the answers before it (the generator's own account, from the chains)."""

    text: str
    value: dict[str, str]
    depth: dict[str, int]
    hops: dict[str, int]


def _chain_lengths(rng: random.Random, cfg: SyntheticConfig, variables: int) -> list[int]:
    """Split ``variables`` into ``cfg.chains`` chains of 1..max_depth each, uniformly over the splits."""
    while True:
        cuts = sorted(rng.sample(range(1, variables), cfg.chains - 1))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, variables])]
        if max(lengths) <= cfg.max_depth:
            return lengths


def make_line(rng: random.Random, cfg: SyntheticConfig, variables: int) -> Line:
    """A line of ``variables`` variables in ``cfg.chains`` chains (see the module docstring)."""
    lengths = _chain_lengths(rng, cfg, variables)
    order = [c for c, n in enumerate(lengths) for _ in range(n)]  # the chain of each definition, interleaved
    rng.shuffle(order)
    names = list(NAMES[:variables]) if cfg.names == "alphabetical" else rng.sample(NAMES, variables)
    # leaves: roots with replacement (no answer follows from another by elimination); all: distinct roots (a
    # chain's value says which chain it is)
    roots = rng.choices(VALUES, k=cfg.chains) if cfg.queries == "leaves" else rng.sample(VALUES, cfg.chains)
    chains: list[list[str]] = [[] for _ in lengths]
    defs = []
    for name, c in zip(names, order):  # a name is defined before it is used
        defs.append(f"{name}{cfg.assign}{chains[c][-1] if chains[c] else roots[c]}")
        chains[c].append(name)
    value = {v: roots[c] for c, chain in enumerate(chains) for v in chain}
    depth = {v: i + 1 for chain in chains for i, v in enumerate(chain)}
    # queries: no ancestor is answered before a descendant (its answer would shorten the descendant's chase)
    if cfg.queries == "leaves":
        asked = [chain[-1] for chain in chains]
        rng.shuffle(asked)
    elif cfg.names == "alphabetical":
        asked = names[::-1]  # reverse definition order
    else:  # interleaved at random, each chain deepest first
        rng.shuffle(order)
        left = list(lengths)
        asked = []
        for c in order:
            left[c] -= 1
            asked.append(chains[c][left[c]])
    hops: dict[str, int] = {}
    for v in asked:  # along v's chain: to the root's digit, or to the nearest answered variable and its answer
        chain = next(chain for chain in chains if v in chain)
        i = chain.index(v)
        hops[v] = min([i + 1] + [abs(j - i) + 1 for j, u in enumerate(chain) if u in hops])
    queries = "".join(f"?{v}{value[v]}" for v in asked)
    return Line(text=",".join(defs) + ";" + queries + "\n", value=value, depth=depth, hops=hops)


def make_document(rng: random.Random, cfg: SyntheticConfig, chars: int) -> tuple[str, list[Line]]:
    """Whole lines filling ``chars`` characters, the rest ``.`` padding; a line's size is drawn from
    min..max_variables, the last one shrunk to what still fits (down to one variable per chain)."""
    lines: list[Line] = []
    used = 0
    while True:
        room = [n for n in range(cfg.chains, cfg.max_variables + 1) if used + cfg.line_chars(n) <= chars]
        if not room:
            break
        n = rng.randint(cfg.min_variables, cfg.max_variables)
        line = make_line(rng, cfg, n if n in room else room[-1])
        lines.append(line)
        used += len(line.text)
    return "".join(line.text for line in lines) + PAD * (chars - used), lines


def documents(cfg: SyntheticConfig, *, seed: int, chars: int) -> Iterator[tuple[str, str]]:
    """``(name, text)`` forever: document i is a pure function of ``(seed, i)`` and ``cfg``."""
    if chars < cfg.line_chars(cfg.min_variables):
        raise ConfigError(
            f"seq_len {chars}: a synthetic document holds whole lines of {cfg.line_chars(cfg.min_variables)} or more "
            "characters; raise seq_len or lower prepare.synthetic.min_variables"
        )
    i = 0
    while True:
        yield f"{cfg.task}-{i}", make_document(random.Random(f"{seed}/{i}"), cfg, chars)[0]
        i += 1


# ------------------------------------------------------------------------------------ reference solver
def solve_line(line: str, assign: str = "") -> list[tuple[int, int]]:
    """(offset of the answer character in ``line``, hops) for every query of one line, from the text alone.

    The hops of a query are the fewest lookups from its variable to a value in view: along definitions
    in either direction (``cb`` leads from c to b, and from b to c), each one lookup, to a digit (a chain's
    root: one more lookup) or to a variable an earlier query answered (one more, to that answer). Asked
    after its child, an ancestor is two lookups away however deep it sits. Raises ValueError when the line
    is not of the task's form or an answer is wrong."""
    defs_text, sep, queries = line.partition(";")
    if not sep:
        raise ValueError("no ';' between assignments and queries")
    rhs: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    for item in defs_text.split(","):
        name, middle, right = item[:1], item[1:-1], item[-1:]
        if not (middle == assign and len(item) == 2 + len(assign) and name in NAMES and name not in rhs):
            raise ValueError(f"assignment {item!r} is not x{assign}y with one-letter names, each defined once")
        if right not in VALUES and right not in rhs:
            raise ValueError(f"{item!r} uses {right!r} before it is defined")
        rhs[name] = right
        users.setdefault(right, []).append(name)
    if len(queries) % 3:
        raise ValueError("queries are not ?xv triples")
    answered: dict[str, str] = {}
    out = []
    for q in range(0, len(queries), 3):
        mark, name, given = queries[q], queries[q + 1], queries[q + 2]
        if mark != "?" or name not in rhs:
            raise ValueError(f"query {queries[q : q + 3]!r} is not ?<defined name><value>")
        at = name  # the value, by the definitions alone
        while at not in VALUES:
            at = rhs[at]
        if given != at:
            raise ValueError(f"query ?{name} answers {given!r}, the assignments give {at!r}")
        hops, seen, frontier = 0, {name}, [name]  # breadth-first over the definitions, both directions
        while True:
            if any(rhs[v] in VALUES or (v in answered and v != name) for v in frontier):
                hops += 1
                break
            nxt = [u for v in frontier for u in (rhs[v], *users.get(v, ())) if u not in VALUES and u not in seen]
            seen.update(nxt)
            frontier, hops = nxt, hops + 1
        answered[name] = given
        out.append((len(defs_text) + 1 + q + 2, hops))
    return out


def difficulty(text: str, assign: str = "") -> np.ndarray:
    """Per character of a synthetic document: the hops its answer needs (1..), 0 for every other character
    (uint8). Padding (``.``) after the last line is ordinary text."""
    out = np.zeros(len(text), dtype=np.uint8)
    start = 0
    body = text.rstrip(PAD)
    for line in body.splitlines(keepends=True):
        try:
            for offset, hops in solve_line(line.rstrip("\n"), assign):
                out[start + offset] = min(hops, MAX_DIFFICULTY)
        except ValueError as err:
            raise UserError(f"synthetic document: line {line.strip()!r} is not a chains line ({err})") from None
        start += len(line)
    return out


def token_difficulty(tokens: np.ndarray, eos_id: int, assign: str = "") -> np.ndarray:
    """:func:`difficulty` of a byte-tokenised document (its ids, then EOS, which is ordinary)."""
    if len(tokens) == 0 or int(tokens[-1]) != eos_id or int(tokens[:-1].max(initial=0)) > 255:
        raise UserError("synthetic document: not byte tokens followed by EOS; set tokenizer.kind: byte")
    out = np.zeros(len(tokens), dtype=np.uint8)
    out[:-1] = difficulty(tokens[:-1].astype(np.uint8).tobytes().decode("ascii"), assign)
    return out
