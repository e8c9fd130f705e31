"""Tag lines (issue 20): every value quoted where needed, so no value can end the line or forge
another; simple values stay bare and old lines still parse."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.tags import EXITED_PREFIX, PREFIX, defang, format_exited, format_tag, parse_exited, parse_tag

keys = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
values = st.one_of(st.text(max_size=40), st.integers(), st.text(alphabet="\n\r\t \"\\=#\u202e\x00ab", max_size=20))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, values, max_size=6))
def test_any_values_make_one_tag_line_that_reads_back(fields):
    line = format_tag(**fields)
    assert line.splitlines() == [line] and line.startswith(PREFIX.strip())
    assert "\n" not in line and "\r" not in line and "\u202e" not in line
    assert parse_tag(line) == {k: str(v).replace(" ", "_") for k, v in fields.items()}
    assert parse_exited(format_exited(**fields)) == parse_tag(line)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="# hangdocprsexit\n[]:0=", max_size=80))
def test_defanged_text_holds_no_tag_or_exited_line(text):
    for line in defang(text).splitlines():
        assert parse_tag(line) is None and parse_exited(line) is None
        assert "# hangdoc " not in line


def test_old_unquoted_lines_parse_as_before():
    line = "# hangdoc process host=node1 pid=42 rank=3 local_rank=3 world_size=8 reason=no_progress_for_1.0s junk"
    assert parse_tag(line) == {"host": "node1", "pid": "42", "rank": "3", "local_rank": "3", "world_size": "8",
                               "reason": "no_progress_for_1.0s"}
    assert parse_exited(EXITED_PREFIX + "pid=7 rank=1")["rank"] == "1"
    # a value that merely starts with a quote is read bare, as before
    assert parse_tag('# hangdoc process host="n1 pid=7')["host"] == '"n1'


def test_a_newline_in_a_value_cannot_forge_a_line():
    line = format_tag(host="n1\n# hangdoc process host=forged rank=0", slurm_job="7\r\n# hangdoc exited pid=1")
    assert len(line.splitlines()) == 1
    assert parse_tag(line)["host"] == "n1\n#_hangdoc_process_host=forged_rank=0"


# What the readers drop before they look for a tag (NULs, CSI and OSC sequences, nested or spanning
# a line break, C1 CSI), and text around it.
_JUNK = ["\x1b", "[", "0m", "]0;t", "\x07", "\x1b\\", "\x00", "\x9b", "\n", "\r", "\r\n", " ", "x", "#"]
_junk = st.lists(st.sampled_from(_JUNK), max_size=8).map("".join)


def _read(text):
    from hangdoc.readers import read_text
    job = read_text(format_tag(host="real", pid=1, rank=0) + "\nProcess 1: python x\n" + text
                    + "\nPython v3.11.7 (/usr/bin/python3)\n\nThread 1 (idle): \"MainThread\"\n    main (x.py:1)\n")
    return [(p.host, p.pid, p.status) for p in job.processes]


@settings(max_examples=300, deadline=None)
@given(_junk, _junk, _junk, st.sampled_from(["process", "exited"]))
def test_defanged_text_holds_no_tag_once_the_readers_drop_escapes_and_nuls(before, inside, after, kind):
    text = f"{before}\n#{inside} hangdoc {kind} host=forged pid=9 rank=1 reason=x\n{after}"
    assert _read(defang(text)) == [("real", 1, "ok")]


def test_an_escape_or_nul_inside_the_tag_word_is_defanged():
    for forged in ("#\x1b[0m hangdoc process host=forged pid=9", "#\x00 hangdoc process host=forged pid=9",
                   "#\x1b]0;t\n\x07 hangdoc exited pid=9", "#\x1b\x1b[0m[0m hangdoc process host=forged pid=9",
                   "#\x9b0m hangdoc process host=forged pid=9"):
        out = defang("a\n" + forged)
        assert "\x1b" not in out and "\x00" not in out and "\x9b" not in out, repr(out)
        assert _read(out) == [("real", 1, "ok")], (repr(out), _read(out))


def test_a_section_header_in_dumper_output_names_no_rank():
    for forged in ("=== Rank 5: forged:1 ===", "2024-05-01T10:00:00Z === Rank 5: forged ===", "x\r=== Rank 5 ===",
                   "=\x1b[0m== Rank 5: forged ==="):
        assert _read(defang(forged)) == [("real", 1, "ok")], (forged, _read(defang(forged)))
