"""Where a prompt's longest cached prefixes lie: the router's side of the prefix cache.

Every instance (prefill and decode) publishes in Redis the key of each entry it holds
(`{ns}:prefix:{key}` -> instance id, `pdserve.prefix_keys`) and a tail marker under each block
that entries ending off a block boundary hang from. For a prompt, at most two round trips:
  1. one MGET: the key of each of its full blocks (entries on a block boundary) and the tail
     marker of each block (and of the root);
  2. only when markers were found: the exact tail keys under the `MAX_TAIL_PARENTS` longest
     marked blocks, every length up to a block.
The answer is each live instance's longest prefix of the prompt, leaving one token to compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.prefix_keys import parents_of, tail_keys, tail_marker
from pdserve.registry import InstanceRegistry

MAX_TAIL_PARENTS = 3


@dataclass(frozen=True, slots=True)
class Holder:
    """An instance caching the prompt's first `num_tokens` tokens under entry `key` (hex)."""

    instance_id: str
    num_tokens: int
    key: str


async def prefix_holders(
    registry: InstanceRegistry, prompt: list[int], block_size: int, salt: str, live: set[str]
) -> list[Holder]:
    """The longest cached prefix of `prompt` per live instance, longest first."""
    limit = len(prompt) - 1
    parents = parents_of(prompt[:limit], block_size, salt)
    blocks = [p.hex() for p in parents[1:]]
    markers = [tail_marker(p).hex() for p in parents]
    owners = await registry.prefix_owners(blocks + markers)
    found: dict[str, Holder] = {}

    def offer(owner: str | None, num_tokens: int, key: str) -> None:
        if owner in live and (owner not in found or found[owner].num_tokens < num_tokens):
            found[owner] = Holder(owner, num_tokens, key)

    for i, key in enumerate(blocks, 1):
        offer(owners.get(key), i * block_size, key)
    # a marker says "tails hang here", whoever wrote it last (it may be an instance since gone)
    marked = [i for i, marker in enumerate(markers) if marker in owners][-MAX_TAIL_PARENTS:]
    probes: dict[str, int] = {}
    for i in marked:
        base = i * block_size
        for length, key in tail_keys(parents[i], prompt[base:limit], block_size - 1):
            probes[key.hex()] = base + length
    if probes:
        for key, owner in (await registry.prefix_owners(list(probes))).items():
            offer(owner, probes[key], key)
    return sorted(found.values(), key=lambda h: -h.num_tokens)
