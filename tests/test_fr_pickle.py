"""hangdoc.readers.fr_pickle builds what pickle builds, or gives up (hypothesis, real dumps), and
bounds the expanded size from above, never below."""

import glob
import io
import os
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.readers import flight_recorder, fr_pickle

HERE = os.path.dirname(os.path.abspath(__file__))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=False),
                    st.text(max_size=20))
keys = st.one_of(st.text(max_size=10), st.integers(-5, 300), st.tuples(st.integers(0, 3)))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(keys, inner, max_size=6), st.tuples(inner), st.tuples(inner, inner),
    st.tuples(inner, inner, inner), st.lists(inner, min_size=4, max_size=8).map(tuple)), max_leaves=40)


def same(a, b):
    """Equal, or equal but for NaNs (a flipped byte of a float can make one; nan != nan)."""
    return a == b or repr(a) == repr(b)


def general(data):
    """What the pure-Python path of flight_recorder makes of ``data``: the value or the error."""
    try:
        u = flight_recorder._NoGlobalsUncounted(io.BytesIO(data))
        return ("ok", u.load())
    except Exception as e:
        return ("error", type(e).__name__)


def fast(data, tight=True):
    """fr_pickle's value, its bound checked against the walk's expanded size (every shared reference
    counted each time): never below it, and (``tight``: a pickle that drops no value, as picklers
    write them) above it by at most one per byte."""
    got, bound = fr_pickle.loads(data)
    size = flight_recorder._expanded_size(got)
    assert size <= bound, (size, bound, len(data))
    assert not tight or bound <= size + len(data), (size, bound, len(data))
    return ("ok", got)


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from([2, 3]))
def test_the_same_value_as_pickle(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    got = fast(data)
    assert got[1] == pickle.loads(data) and type(got[1]) is type(value)
    assert got == general(data)


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_a_broken_pickle_is_refused_or_read_as_the_general_path_reads_it(value, data):
    raw = bytearray(pickle.dumps([value, value], protocol=2))
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.sampled_from(["flip", "cut", "dup"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if how == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del raw[at:]
        else:
            raw[at:at] = raw[at:at + data.draw(st.integers(1, 8))]
        if not raw:
            return
    try:
        got = fast(bytes(raw), tight=False)
    except AssertionError:
        raise
    except Exception:
        return  # the caller falls back to the general path, whose answer stands
    assert same(got, general(bytes(raw)))


def test_protocol_4_frames_and_globals_go_to_the_general_path():
    for data in (pickle.dumps({"a": [1]}, protocol=4), pickle.dumps({"a": {1, 2}}, protocol=2)):
        try:
            fr_pickle.loads(data)
        except fr_pickle.Unsupported:
            continue
        raise AssertionError(data)


def test_every_real_flight_recorder_dump_loads_fast_and_the_same():
    paths = [p for p in glob.glob(os.path.join(HERE, "fixtures", "**", "*"), recursive=True)
             if os.path.basename(p).startswith(("nccl_trace_rank_", "fr_trace_rank_"))]
    seen = 0
    for p in paths:
        data = open(p, "rb").read()
        if not flight_recorder._is_pickle(data[:4]):
            continue
        seen += 1
        assert fast(data) == general(data), p
        assert fr_pickle.loads(data)[1] <= flight_recorder.MAX_NODES  # never walked again
    assert seen >= 10


@pytest.mark.parametrize("name,k", [("fr_trace_rank_3", 8), ("fr_trace_rank_2", 5)])
def test_a_dump_of_one_repeated_line_is_not_walked_after_it_loads(monkeypatch, name, k):
    # found by the fuzz check run of 2026-11-28 (seed 106, input 5380): one "line" of a real dump
    # (the opcodes of part of an entry, its frame dicts fetched from the memo) 20,000 times, 3.3 MB:
    # 1 s to load and 1 s more to walk it for the expanded size; its shared frames are counted as it
    # loads now, and the walk is not needed. Line 5 sets an entry's keys again (6.6 MB): the fast
    # loader reads that too (a value dropped is still counted in the bound)
    lines = open(os.path.join(HERE, "fixtures", "records", "skip_broadcast", name), "rb").read().split(b"\n")
    data = b"\n".join(lines[:k] + [lines[k]] * 20_000 + lines[k + 1:])

    def walked(obj):
        raise AssertionError("walked")

    monkeypatch.setattr(flight_recorder, "_check_size", walked)
    assert fr_pickle.loads(data)[1] < len(data) * 2  # the fast loader, not the general path
    assert len(flight_recorder.loads(data)["entries"]) >= 3


def test_shared_references_past_the_limit_are_refused_on_the_fast_path_too():
    shared = list(range(5000))
    data = pickle.dumps({"entries": [{"input_sizes": [shared] * 5000}] * 5000}, protocol=2)
    assert fr_pickle.loads(data)[1] > flight_recorder.MAX_NODES  # read by the fast loader, which counted
    try:
        flight_recorder.loads(data)
    except ValueError as e:
        assert str(e) == "not a Flight Recorder dump: more than 10000000 values (shared references expanded)"
    else:
        raise AssertionError("read")


def _u(s):
    b = s.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


def test_a_container_added_to_after_it_was_fetched_goes_to_the_general_path():
    # {"entries": L} where L gets itself after it was fetched; and {"a": L, "b": L, "c": M} where M,
    # inside L, gets L after both were fetched: no pickler writes either, both are loops
    self_loop = b"\x80\x02}" + _u("entries") + b"]q\x01(h\x01es."
    inner_loop = (b"\x80\x02}" + _u("entries") + b"]q\x01]q\x02as" + _u("b") + b"h\x01s" + _u("c")
                  + b"h\x02(h\x01es.")
    for data in (self_loop, inner_loop):
        try:
            fr_pickle.loads(data)
        except fr_pickle.Unsupported:
            pass
        else:
            raise AssertionError(data)
        try:
            flight_recorder.loads(data)
        except ValueError as e:
            assert str(e) == "not a Flight Recorder dump: a container that contains itself", data
        else:
            raise AssertionError(data)
