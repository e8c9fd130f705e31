"""What each column of the bug matrix said, and whether that was right: pure functions on text and JSON.

A **verdict** is ``{"kind": str or None, "culprits": [rank, ...], "summary": str}`` (``None`` when
the tool said nothing); :func:`judge` compares it with a scenario's ``TRUTH``:

* ``CRASH``: the tool itself failed (a traceback, a non-zero exit without output);
* ``NONE``: no verdict (except on a job that only was slow: there, silence is right), or a
  timeout that names nobody (``hang-unattributed``; on a job that only was slow, that is WRONG);
* ``WRONG``: an innocent rank blamed, or a wrong kind that names no culprit at all;
* ``RIGHT``: the right kind (``SAME_KIND`` lists the doc kinds that stand for a kind the docs lack
  yet), every culprit, nobody else;
* ``PARTIAL``: some culprits (no innocent), or the right kind without every culprit.

    >>> truth = {"kind": "collective-mismatch", "culprits": [5, 6]}
    >>> judge(truth, {"kind": "collective-mismatch", "culprits": [5, 6]})
    'RIGHT'
    >>> judge(truth, {"kind": "collective-mismatch", "culprits": [5]})
    'PARTIAL'
    >>> judge(truth, {"kind": "collective-wait", "culprits": [5, 6]})
    'PARTIAL'
    >>> judge(truth, {"kind": "collective-mismatch", "culprits": [0, 5, 6]})
    'WRONG'
    >>> judge(truth, None)
    'NONE'
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Dict, List, Optional

#: kinds a scenario's TRUTH may use that docs/findings does not have yet -> the doc kinds that say the same
SAME_KIND = {"slow-not-hung": {"no-hang"}}
#: kinds that claim there is no hang
NO_HANG = {"no-hang", "slow-not-hung"}
#: a tool that says the job timed out (hung) but names nobody: no verdict on a hang, wrong on a job
#: that was only slow
UNATTRIBUTED = "hang-unattributed"
CELLS = ("RIGHT", "PARTIAL", "WRONG", "NONE", "CRASH")


def judge(truth: Dict[str, Any], verdict: Optional[Dict[str, Any]]) -> str:
    """RIGHT / PARTIAL / WRONG / NONE / CRASH for one cell (see the module docstring)."""
    if verdict is not None and verdict.get("crash"):
        return "CRASH"
    slow = truth["kind"] == "slow-not-hung"
    if verdict is None or not verdict.get("kind"):
        return "RIGHT" if slow else "NONE"
    kind = verdict["kind"]
    if kind == UNATTRIBUTED and not verdict.get("culprits"):
        return "WRONG" if slow else "NONE"
    kind_ok = kind == truth["kind"] or kind in SAME_KIND.get(truth["kind"], ())
    blamed = set(r for r in verdict.get("culprits") or [] if r is not None)
    guilty = set(truth["culprits"])
    if blamed - guilty:
        return "WRONG"
    if kind_ok and blamed == guilty:
        return "RIGHT"
    if blamed & guilty or kind_ok:
        return "PARTIAL"
    return "WRONG"


# --- hangdoc's own outputs -------------------------------------------------------------------

def from_report(report: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The headline (``findings[0]``) of a hangdoc JSON report (``report.json``, ``aggregate --format json``)."""
    findings = report.get("findings") or []
    if not findings:
        return None
    f = findings[0]
    culprits = sorted(set(c.get("rank") for c in f.get("culprits") or [] if c.get("rank") is not None))
    unknown = sum(1 for c in f.get("culprits") or [] if c.get("rank") is None)
    out = {"kind": f.get("kind"), "culprits": culprits, "summary": f.get("summary", "")}
    if unknown:
        out["culprits_without_rank"] = unknown
    return out


def from_divergence(div: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``--detect``'s ``divergence.json``: the deviants of a diverged collective."""
    if not div or not div.get("deviants"):
        return None
    return {"kind": "collective-mismatch", "culprits": sorted(set(int(r) for r in div["deviants"])),
            "summary": div.get("summary", "")}


# --- TORCH_DISTRIBUTED_DEBUG=DETAIL ----------------------------------------------------------------

# "Detected mismatch between collectives on ranks. Rank 2 is running collective: CollectiveFingerPrint(...),
# but Rank 0 is running collective: CollectiveFingerPrint(...)." (ProcessGroupWrapper.cpp); the fingerprints
# nest parentheses (TensorOptions(...)), so a side is cut at the next "but Rank" or the end of the line.
_SIDE = re.compile(r"Rank (\d{1,6}) is running collective: CollectiveFingerPrint\(")
_FIELDS = re.compile(r"(OpType|TensorShape|TensorDtypes)=(\[[^\]\n]{0,400}\]|\w{1,40})")
# "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 8000 ms" / "Rank 2 failed to pass monitoredBarrier"
_BARRIER = re.compile(r"Ranks? ([\d, ]{1,400}) failed to pass monitoredBarrier")
# a timeout that names nobody ("... received errors while waiting for send/recv from rank 0. Please check
# rank 0 logs for faulty rank." points at the barrier's coordinator's log, not at a culprit)
_TIMEOUT = re.compile(r"Timed out waiting \d{1,12}ms|received errors while waiting for send/recv|monitoredBarrier")


def fingerprints(text: str) -> Dict[int, str]:
    """{rank: "OpType=... TensorShape=... TensorDtypes=..."} from DETAIL's mismatch lines (the
    sequence number left out). A rank's own line ("Rank 1 is running ..., but Rank 0 ...") wins
    over what another rank's line says of it: measured, rank 0's line can show rank 1 in an
    internal GATHER of sequence 0 while rank 1's own line shows its ALLREDUCE."""
    own: Dict[int, str] = {}
    other: Dict[int, str] = {}
    for m in _SIDE.finditer(text):
        end = text.find("\n", m.end())
        end = len(text) if end < 0 else end
        but = text.find("but Rank", m.end(), end)
        side = text[m.end():but if but >= 0 else end][:3000]
        fp = " ".join(f"{k}={v}" for k, v in _FIELDS.findall(side))
        target = other if text[max(0, m.start() - 4):m.start()] == "but " else own
        target.setdefault(int(m.group(1)), fp)
    other.update(own)
    return other


def from_detail_log(text: str) -> Optional[Dict[str, Any]]:
    """What a ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` job printed that names ranks, as a verdict.

    A fingerprint mismatch names two ranks per line; every line is one rank's view. The ranks whose
    fingerprint differs from the most common one are blamed (all ranks with a fingerprint when no
    fingerprint is more common than the others). A ``monitoredBarrier`` timeout names the ranks that
    did not arrive. Both are collective-mismatch: DETAIL has no finer kinds. A timeout that names
    nobody is ``hang-unattributed``.

        >>> log = ("Rank 2 is running collective: CollectiveFingerPrint(SequenceNumber=9, OpType=ALLREDUCE, "
        ...        "TensorShape=[8], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default))), "
        ...        "but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=9, OpType=BROADCAST, "
        ...        "TensorShape=[8], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default))).")
        >>> from_detail_log(log + "\\n" + log.replace("Rank 0", "Rank 1"))["culprits"]
        [2]
    """
    prints = fingerprints(text)
    if prints:
        counts = Counter(prints.values())
        top = counts.most_common()
        if len(top) > 1 and top[0][1] > top[1][1]:
            culprits = sorted(r for r, fp in prints.items() if fp != top[0][0])
        else:
            culprits = sorted(prints)
        return {"kind": "collective-mismatch", "culprits": culprits,
                "summary": _first_line(text, "is running collective")}
    blamed: List[int] = []
    for m in _BARRIER.finditer(text):
        blamed.extend(int(x) for x in re.findall(r"\d{1,6}", m.group(1)))
    if blamed:
        return {"kind": "collective-mismatch", "culprits": sorted(set(blamed)),
                "summary": _first_line(text, "failed to pass monitoredBarrier")}
    m = _TIMEOUT.search(text)
    if m:
        return {"kind": UNATTRIBUTED, "culprits": [], "summary": _line_at(text, m.start())}
    return None


# --- Flight Recorder's fr_trace --------------------------------------------------------------------

_FR_MISSING = re.compile(r"missing ranks: \{([\d, ]{0,4000})\}")
_FR_CULPRIT = re.compile(r"Culprit rank (\d{1,6})")


def from_fr_trace(text: str, returncode: int) -> Optional[Dict[str, Any]]:
    """fr_trace's first reported problem: ``missing ranks: {...}`` or ``Culprit rank N`` (both
    collective-mismatch: fr_trace names ranks that did not join, or joined with another op/size).
    A traceback is a crash.

        >>> from_fr_trace("...\\nmissing ranks: {2}\\n", 0)["culprits"]
        [2]
        >>> from_fr_trace("Traceback (most recent call last):\\nKeyError: ('0', 3)\\n", 1)["crash"]
        "KeyError: ('0', 3)"
    """
    if "Traceback (most recent call last)" in text or (returncode != 0 and not text.strip()):
        last = [ln for ln in text.strip().splitlines() if ln.strip()]
        return {"crash": last[-1][:300] if last else f"exit status {returncode}"}
    first = None
    for pattern in (_FR_MISSING, _FR_CULPRIT):
        m = pattern.search(text)
        if m and (first is None or m.start() < first.start()):
            first = m
    if first is None:
        return None
    if first.re is _FR_MISSING:
        culprits = sorted(set(int(x) for x in re.findall(r"\d{1,6}", first.group(1))))
    else:
        line = text[first.start():text.find("\n", first.start()) if "\n" in text[first.start():] else len(text)]
        culprits = sorted(set(int(x) for x in _FR_CULPRIT.findall(line)))
    return {"kind": "collective-mismatch", "culprits": culprits, "summary": _line_at(text, first.start())}


def _first_line(text: str, needle: str) -> str:
    i = text.find(needle)
    return _line_at(text, i) if i >= 0 else ""


def _line_at(text: str, i: int) -> str:
    start = text.rfind("\n", 0, i) + 1
    end = text.find("\n", i)
    return text[start:end if end >= 0 else len(text)].strip()[:300]
