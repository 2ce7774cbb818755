"""Page ids and token slots: the two forms a pool's pages cross the interface in.

Pages are aligned in their pool: page `p` of a pool of `page_size` holds the
slots `p * page_size + [0, page_size)`, so a page is named by its id alone.
The page forms of the request path (`CacheManager.match_pages`, ...) move one
id per page; these convert where an interface still speaks slots.
"""

from __future__ import annotations

import torch


def slots_of_pages(page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of `page_ids` (int32, one row of page_size slots per page,
    in order)."""
    if page_size == 1:
        return page_ids
    ramp = torch.arange(page_size, dtype=torch.int32, device=page_ids.device)
    return (page_ids.view(-1, 1) * page_size + ramp).view(-1)


def pages_of_slots(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page ids of `slots`, whole aligned pages (the first slot of each / page_size)."""
    if page_size == 1:
        return slots
    return slots[::page_size] // page_size
