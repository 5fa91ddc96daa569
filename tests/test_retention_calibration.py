"""The calibration windows of retention/retention.py (issue 21): each starts at a file's first token, spread over
files."""

import numpy as np
import pytest

from retention import retention

SEP = 9


def corpus(lengths, seed=0):
    """Files of the given lengths, tokens 0..8 (never the separator), each file but the last followed by SEP;
    returns the ids and every file's first position."""
    rng = np.random.default_rng(seed)
    parts, starts, at = [], [], 0
    for i, n in enumerate(lengths):
        starts.append(at)
        parts.append(rng.integers(0, SEP, n))
        at += n
        if i < len(lengths) - 1:
            parts.append([SEP])
            at += 1
    return np.concatenate(parts).astype(np.uint16), starts


def test_windows_begin_at_file_starts_spread_over_the_files():
    lengths = [30, 5, 12, 40, 7, 25, 33, 18, 9, 50]
    ids, starts = corpus(lengths)
    w = retention.file_start_windows(ids, 4, SEP, seq_len=16)
    assert w.shape == (4, 16) and w.dtype == np.int64
    usable = [s for s in starts if s + 16 <= ids.size]  # the last file's 50 tokens leave room
    found = [next(s for s in usable if np.array_equal(ids[s : s + 16], row)) for row in w]
    assert found[0] == 0 and found[-1] == usable[-1]  # the first and the last file
    assert found == sorted(found) and len(set(found)) == 4
    every = retention.file_start_windows(ids, len(usable), SEP, seq_len=16)
    assert [row.tolist() for row in every] == [ids[s : s + 16].tolist() for s in usable]
    assert SEP in every[1]  # the 5-token file's window runs on into the next file


def test_too_many_windows_name_the_split():
    ids, _ = corpus([20, 20, 20])
    assert len(retention.file_start_windows(ids, 3, SEP, seq_len=16)) == 3
    with pytest.raises(SystemExit, match="train_code.npy: 4 calibration windows at file starts asked, 3 files"):
        retention.file_start_windows(ids, 4, SEP, seq_len=16)
