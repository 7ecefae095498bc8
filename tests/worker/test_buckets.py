"""The bucket table: every padded size a step can take, and the one lookup."""

import pytest

from jaxserve.worker.buckets import BucketTable, bucket, power_of_two_buckets


def test_power_of_two_buckets_always_end_at_the_largest():
    assert power_of_two_buckets(1, 8) == [1, 2, 4, 8]
    assert power_of_two_buckets(1, 12) == [1, 2, 4, 8, 12]
    assert power_of_two_buckets(4, 2) == [2]


def test_the_smallest_bucket_that_holds_n():
    assert [bucket([1, 4, 16], n) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="17 is over the largest bucket, 16"):
        bucket([1, 4, 16], 17)


def test_the_table_of_a_runner():
    t = BucketTable.build(max_num_seqs=8, max_num_batched_tokens=32)
    assert t.tokens == (1, 2, 4, 8, 16, 32) and t.seqs == (1, 2, 4, 8)
    assert t.samples == (1, 2, 4, 8) and t.max_sample_rows == 8
    assert [t.forward_seqs(n) for n in (1, 4, 32)] == [1, 4, 8]
    assert t.decode_top == 8
    assert t.forward_variants(False) == [(n, False) for n in t.tokens]
    decode = [(1, True), (2, True), (4, True), (8, True)]
    assert t.forward_variants(True) == decode + [(n, False) for n in (2, 4, 8, 16, 32)]


def test_drafts_add_sampling_rows_and_their_width_as_a_bucket():
    t = BucketTable.build(max_num_seqs=4, max_num_batched_tokens=16, num_spec_tokens=2)
    assert t.max_sample_rows == 12  # 4 requests x (1 + 2)
    assert t.tokens == (1, 2, 3, 4, 8, 16) and t.samples == (1, 2, 3, 4, 8, 12)
    capped = BucketTable.build(max_num_seqs=4, max_num_batched_tokens=6, num_spec_tokens=4)
    assert capped.max_sample_rows == 6  # never more rows than the step has tokens


def test_coarse_tables_keep_the_decode_and_largest_buckets():
    """JAXSERVE_MINIMAL_COMPILE's table: a decode of every sequence and the fullest step still
    have their own bucket, every smaller step pads up, and no forward's sequence rows exceed
    its tokens."""
    t = BucketTable.build(max_num_seqs=8, max_num_batched_tokens=64, coarse=True)
    assert (t.tokens, t.seqs, t.samples) == ((8, 64), (8,), (8,))
    assert t.decode_top == 8 and t.token(1) == 8 and t.sample(1) == 8
    spec = BucketTable.build(max_num_seqs=8, max_num_batched_tokens=64, num_spec_tokens=3,
                             coarse=True)  # fmt: skip
    assert (spec.tokens, spec.seqs, spec.samples) == ((4, 8, 64), (4, 8), (4, 32))
    for table in (t, spec, BucketTable.build(16, 16, coarse=True)):
        assert all(table.forward_seqs(n) <= n for n in table.tokens)
