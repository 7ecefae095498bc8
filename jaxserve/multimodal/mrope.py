"""Qwen2.5-VL's M-RoPE positions (3 axes: temporal, height, width), on the host, numpy only.

Text tokens take the same position on all three axes, one more than the token before. An
image's (or video's) placeholder tokens, one per merged patch in the processor's row-major
order, take (start + t * interval, start + row, start + column) with start the position the
next text token would have had; the text after it continues from start + max(rows, columns)
(transformers 5.23's `Qwen2_5_VLModel.get_rope_index`). A token generated after the prompt
at index p (0-based over the whole sequence) has position p + delta on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _vision_positions(start: int, grid: Sequence[int], merge: int, interval: float) -> np.ndarray:
    """One image's or video's grid (t, h, w) in patches -> i64[3, t * h * w / merge**2]."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    # HF: (arange(t) * interval).long() in float32, then + start
    temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
    tt, hh, ww = np.meshgrid(temporal, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    input_ids: Sequence[int] | np.ndarray,
    image_grid_thw: np.ndarray | Sequence[Sequence[int]] | None,
    *,
    image_token_id: int,
    vision_start_token_id: int | None = None,
    spatial_merge_size: int,
    video_grid_thw: np.ndarray | Sequence[Sequence[int]] | None = None,
    video_token_id: int | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
    tokens_per_second: float | None = None,
) -> tuple[np.ndarray, int]:
    """A prompt's token ids [L] (each image's placeholder already expanded to t * h * w /
    merge**2 tokens, as the HF processor leaves them) and its images' grids [num_images, 3]
    (patches, the image processor's image_grid_thw) -> (i32[3, L] positions, delta): a token
    after the prompt at index p has position p + delta on all three axes (HF's
    `mrope_position_deltas`).

    Images (and videos: video_grid_thw [num_videos, 3] with video_token_id, the temporal axis
    stepping tokens_per_second (the vision config's; required with videos) times
    second_per_grid_ts[i] (1 second when not given)) are taken in prompt order; consecutive
    placeholders are split by their grids' token counts, so two adjacent images need no text
    between them. vision_start_token_id is accepted for HF's older signature and not needed:
    the placeholder tokens themselves mark the images."""
    del vision_start_token_id
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    merge = spatial_merge_size
    grids = {
        image_token_id: [] if image_grid_thw is None else np.asarray(image_grid_thw).reshape(-1, 3),
    }
    if video_token_id is not None:
        grids[video_token_id] = (
            [] if video_grid_thw is None else np.asarray(video_grid_thw).reshape(-1, 3)
        )
    used = dict.fromkeys(grids, 0)
    seconds = list(second_per_grid_ts) if second_per_grid_ts is not None else None
    chunks: list[np.ndarray] = []
    pos, i, n = 0, 0, len(ids)
    while i < n:
        token = int(ids[i])
        if token not in grids:
            j = i
            while j < n and int(ids[j]) not in grids:
                j += 1
            chunks.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
            pos += j - i
            i = j
            continue
        k = used[token]
        if k >= len(grids[token]):
            raise ValueError(f"more placeholder runs of token {token} than grids ({k})")
        grid = grids[token][k]
        used[token] += 1
        length = int(np.prod(grid)) // merge**2
        if not np.all(ids[i : i + length] == token):
            raise ValueError(f"placeholder {token} at {i}: fewer than its grid's {length} tokens")
        interval = 1.0
        if token != image_token_id:
            if tokens_per_second is None:
                raise ValueError("videos need the vision config's tokens_per_second")
            interval = tokens_per_second * (1.0 if seconds is None else seconds[k])
        chunks.append(_vision_positions(pos, grid, merge, interval))
        pos += max(int(grid[1]), int(grid[2])) // merge
        i += length
    for token, count in used.items():
        if count != len(grids[token]):
            raise ValueError(f"{len(grids[token])} grids for token {token}, {count} in the prompt")
    if not chunks:
        return np.zeros((3, 0), np.int32), 0
    positions = np.concatenate(chunks, axis=1)
    delta = int(positions.max()) + 1 - n
    return positions.astype(np.int32), delta
