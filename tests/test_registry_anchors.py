"""Every log reader's keywords are covered by registry.ANCHORS: a stretch of a big file with no
anchor is skipped undecoded, so a keyword whose lines hold no anchor is never seen there (a new log
format would be read in small files and silently not in big ones).

A keyword is covered when it holds an anchor itself, or when its module says which anchor its lines
carry as the program prints them (``LINE_ANCHORS``: "Last enqueued" lines come with glog's
"ProcessGroupNCCL.cpp"), or that it is read only inside a block an anchored line opened
(``INNER_KEYWORDS``: torchrun's "[0]:" entries after "Failures:"). tests/test_readers_skip.py checks
the same on every real fixture, read with skipping on.
"""

from hangdoc.readers import registry


def _uncovered():
    anchors = [a.decode() for a in registry.ANCHORS]
    out = []
    for mod in registry.log_modules():
        line_anchors = getattr(mod, "LINE_ANCHORS", {})
        inner = getattr(mod, "INNER_KEYWORDS", ())
        for word in mod.KEYWORDS:
            if any(a in word for a in anchors) or word in inner:
                continue
            carried = line_anchors.get(word)
            if carried is None or carried not in anchors:
                out.append((mod.__name__, word))
    return out


def test_every_log_keyword_is_covered_by_an_anchor():
    # found when written: world_log's statements of the world size (no anchor: lost in big files),
    # nccl_log's "got stuck" (now "watchdog got stuck"), and undeclared keywords of detail_log,
    # elastic_log and nccl_log whose lines carry "rror"/"rocess"
    assert _uncovered() == []


def test_declarations_name_only_real_keywords():
    for mod in registry.log_modules():
        for word in getattr(mod, "LINE_ANCHORS", {}):
            assert word in mod.KEYWORDS, (mod.__name__, word)
            assert not any(a.decode() in word for a in registry.ANCHORS), (mod.__name__, word, "needs no declaration")
        for word in getattr(mod, "INNER_KEYWORDS", ()):
            assert word in mod.KEYWORDS, (mod.__name__, word)


def test_every_stack_marker_holds_an_anchor():
    assert [m for m in registry.STACK_MARKERS if not any(a in m for a in registry.ANCHORS)] == []
