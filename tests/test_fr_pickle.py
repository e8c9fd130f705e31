"""hangdoc.readers.fr_pickle builds what pickle builds, or gives up (hypothesis, real dumps)."""

import glob
import io
import os
import pickle

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


def general(data):
    """What the pure-Python path of flight_recorder makes of ``data``: (value, shared) or the error."""
    try:
        u = flight_recorder._NoGlobalsUncounted(io.BytesIO(data))
        return ("ok", u.load(), u.shared)
    except Exception as e:
        return ("error", type(e).__name__)


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from([2, 3]))
def test_the_same_value_as_pickle(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    got, shared = fr_pickle.loads(data)
    assert got == pickle.loads(data) and type(got) is type(value)
    assert ("ok", got, shared) == general(data)


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
        got = fr_pickle.loads(bytes(raw))
    except Exception:
        return  # the caller falls back to the general path, whose answer stands
    assert ("ok",) + got == general(bytes(raw))


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
        assert ("ok",) + fr_pickle.loads(data) == general(data), p
    assert seen >= 10
