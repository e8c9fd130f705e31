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


#: the kinds a ``divergence.json`` may carry (hangdoc.runtime.detect_digest.KINDS; a test keeps them equal)
DETECT_KINDS = ("collective-mismatch", "p2p-stall", "p2p-cycle", "rank-failed", "unresponsive-process",
                "dataloader-stall")


def from_divergence(div: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``--detect``'s ``divergence.json``: its deviants, and its kind (a collective mismatch unless it
    names another)."""
    if not div or not div.get("deviants") or div.get("resumed_after") is not None:
        return None  # (a stall the stalled rank went on from: withdrawn by the detector itself)
    kind = div.get("kind") if div.get("kind") in DETECT_KINDS else "collective-mismatch"
    return {"kind": kind, "culprits": sorted(set(int(r) for r in div["deviants"])),
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


# --- nvidia-resiliency-ext's ft_launcher ----------------------------------------------------------

#: ``[RankMonServer28287@vm:0] Did not get subsequent heartbeat. Waited 8.00 seconds.`` (the rank
#: monitor of rank 0; its section timeouts print "Section 'x' has been open ..." / "Was out of section ...")
_NVRX_TIMEOUT = re.compile(r"\[RankMonServer\d{1,10}@[^\]\n]{0,200}?:(\d{1,6})\] (Did not get (?:initial|subsequent) heartbeat"
                           r"|Section '[^'\n]{0,200}' has been open|Was out of section)")
#: torchrun's (and so ft_launcher's) first observed failure: ``failed (exitcode: -9) local_rank: 2 (pid: 123) of binary: ...``
_NVRX_FAILED = re.compile(r"\] failed \(exitcode: (-?\d{1,6})\) local_rank: (\d{1,6})")
_NVRX_WORLD = re.compile(r"^\s*nproc_per_node\s*:\s*(\d{1,6})\s*$", re.M)
_NVRX_NODES = re.compile(r"^\s*max_nodes\s*:\s*(\d{1,6})\s*$", re.M)
#: the kind for ranks a rank monitor says stopped sending heartbeats (nvidia-resiliency-ext's only
#: word on a hang: no TRUTH kind, so at best PARTIAL)
NO_HEARTBEAT = "no-heartbeat"


def from_nvrx_log(text: str) -> Optional[Dict[str, Any]]:
    """What ``ft_launcher`` (nvidia-resiliency-ext's fault tolerance) printed that names ranks.

    Each rank has a rank monitor that prints ``Did not get subsequent heartbeat`` (or a section
    timeout) and ``FT timeout elapsed.`` when its rank sent no heartbeat in time, then kills it.
    The ranks whose monitor said so are named (kind :data:`NO_HEARTBEAT`); when every rank of the
    job (``nproc_per_node`` x ``max_nodes`` of its launch config) timed out, it said only that
    the job hung (:data:`UNATTRIBUTED`, no culprit). Without a timeout, the launcher's first
    observed worker failure (``failed (exitcode: N) local_rank: R``, torchrun's agent code;
    one node, so the local rank is the rank) is ``rank-failed``. A launcher that never started
    its workers is a crash; nothing of these is no verdict.

        >>> log = ("  nproc_per_node   : 2\\n  max_nodes        : 1\\n[..] starting workers for entrypoint: python3\\n"
        ...        "[2026-11-27 23:40:33,793] [WARNING] [RankMonServer28287@vm:1] Did not get subsequent heartbeat. "
        ...        "Waited 8.00 seconds.\\n")
        >>> from_nvrx_log(log)["culprits"], from_nvrx_log(log)["kind"]
        ([1], 'no-heartbeat')
        >>> from_nvrx_log(log + log.replace("vm:1]", "vm:0]"))["kind"]
        'hang-unattributed'
    """
    if "starting workers for entrypoint" not in text:
        last = [ln for ln in text.strip().splitlines() if ln.strip()]
        return {"crash": (last[-1] if last else "no output")[:300]} if last else None
    timed_out = sorted(set(int(m.group(1)) for m in _NVRX_TIMEOUT.finditer(text)))
    if timed_out:
        first = _NVRX_TIMEOUT.search(text)
        w, n = _NVRX_WORLD.search(text), _NVRX_NODES.search(text)
        world = int(w.group(1)) * (int(n.group(1)) if n else 1) if w else None
        out = {"summary": _line_at(text, first.start()), "timed_out": timed_out}
        if world is not None and set(timed_out) >= set(range(world)):
            return dict(out, kind=UNATTRIBUTED, culprits=[])
        return dict(out, kind=NO_HEARTBEAT, culprits=timed_out)
    m = _NVRX_FAILED.search(text)
    if m:
        return {"kind": "rank-failed", "culprits": [int(m.group(2))], "summary": _line_at(text, m.start())}
    return None


# --- torch's debug server (torch.distributed.debug.start_debug_server) ----------------------------

#: the frontend's pages a user opens from its navigation bar; ``/fr_trace`` (``/fr_trace_nccl`` on
#: NCCL) is its only analysis: fr_trace's tables built from every rank's Flight Recorder
DEBUG_SERVER_PAGES = ("/", "/stacks", "/fr_trace", "/fr_trace_json", "/pyspy_dump", "/wait_counters", "/tcpstore",
                      "/torchcomms_health_check")
DEBUG_SERVER_ANALYSIS = ("/fr_trace", "/fr_trace_nccl")
# "<h2>Rank 1: http://vm:35653/handler/dump_traceback?</h2>\n            <p>Failed to fetch: status=408</p>"
_DS_FAILED = re.compile(r"<h2>Rank (\d{1,6}): [^<\n]{0,500}</h2>\s{0,200}<p>Failed to fetch: status=(\d{1,4})</p>")
# the error page of Python's http.server: "<p>Message: Exception: KeyError(('0', 0)).</p>"
_DS_ERROR = re.compile(r"<p>Message: ([^<\n]{0,300})</p>")
_TD_ROW = re.compile(r"<tr>(.{0,20000}?)</tr>", re.S)
_TD_CELL = re.compile(r"<t[dh][^>]{0,100}>(.{0,5000}?)</t[dh]>", re.S)


def from_debug_server(pages: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """What torch's debug server frontend showed, as a verdict; ``pages`` is ``{path: {"status":
    int, "text": str}}`` (``status`` 0 with an ``error`` when the page could not be fetched).

    In order: a collective of the ``/fr_trace`` analysis tables that names ``missing_ranks``
    (collective-mismatch, fr_trace's word); the ranks whose worker did not answer the frontend on
    ``/stacks`` (``Failed to fetch: status=408``: a 404 is a handler the worker lacks, not the
    worker) as ``unresponsive-process``; the analysis page failing (HTTP 500) is a crash. The
    other pages (stacks, py-spy stacks, raw Flight Recorder JSON, wait counters, the store) are
    raw per-rank data that names no rank as a culprit: with nothing else, no verdict.
    """
    for path in DEBUG_SERVER_ANALYSIS:
        page = pages.get(path) or {}
        if page.get("status") == 200:
            missing = _missing_ranks(page.get("text", ""))
            if missing:
                return {"kind": "collective-mismatch", "culprits": missing, "summary": f"{path}: missing_ranks {missing}"}
    stacks = (pages.get("/stacks") or {}).get("text", "")
    failed = sorted(set(int(m.group(1)) for m in _DS_FAILED.finditer(stacks) if m.group(2) != "404"))
    if failed:
        first = next(m for m in _DS_FAILED.finditer(stacks) if m.group(2) != "404")
        return {"kind": "unresponsive-process", "culprits": failed,
                "summary": "/stacks: " + " ".join(re.sub(r"<[^>]{0,20}>", " ", first.group(0)).split())}
    for path in DEBUG_SERVER_ANALYSIS:
        page = pages.get(path) or {}
        if page.get("status", 0) >= 500:
            m = _DS_ERROR.search(page.get("text", ""))
            return {"crash": f"{path}: HTTP {page['status']}: " + (m.group(1) if m else "no message")}
    return None


def _missing_ranks(table_page: str) -> List[int]:
    """The ``missing_ranks`` of the first collective in ``/fr_trace``'s Collectives table (tabulate's
    HTML) that has any; [] when the page has no such column or no rank is missing."""
    header: List[str] = []
    for row in _TD_ROW.finditer(table_page):
        cells = [re.sub(r"<[^>]{0,200}>", "", c).strip() for c in _TD_CELL.findall(row.group(1))]
        if "<th" in row.group(1):
            header = cells
            continue
        if "missing_ranks" in header and len(cells) == len(header):
            ranks = [int(x) for x in re.findall(r"\d{1,6}", cells[header.index("missing_ranks")])]
            if ranks:
                return sorted(set(ranks))
    return []


# --- nvidia-resiliency-ext's in-process restart (inprocess.Wrapper) --------------------------------

#: ``RankShouldRestart('Interruption.SOFT_TIMEOUT on ranks={2}')`` (attribution.format_interruption_records:
#: one "INTERRUPTION on ranks={...}" per kind, joined by ", ")
_IP_RECORD = re.compile(r"Interruption\.([A-Z_]{1,40}) on ranks=\{([\d, ]{0,4000})\}")
#: what each interruption says of its ranks
_IP_KIND = {"SOFT_TIMEOUT": NO_HEARTBEAT, "HARD_TIMEOUT": NO_HEARTBEAT, "UNRESPONSIVE": "unresponsive-process",
            "EXCEPTION": "rank-failed", "BASE_EXCEPTION": "rank-failed", "TERMINATED": "rank-failed",
            "MONITOR_PROCESS_EXCEPTION": "rank-failed"}


def from_nvrx_inprocess_log(text: str) -> Optional[Dict[str, Any]]:
    """The first interruption ``inprocess.Wrapper`` reported (the message of the ``RankShouldRestart``
    it raises in every rank): its ranks, as :data:`NO_HEARTBEAT` for a progress timeout (soft or
    hard), ``unresponsive-process`` for a missing heartbeat, ``rank-failed`` for an exception or a
    terminated rank. A message naming several interruptions is read by its first.

        >>> v = from_nvrx_inprocess_log("... RankShouldRestart('Interruption.SOFT_TIMEOUT on ranks={2}') <- ...")
        >>> v["kind"], v["culprits"]
        ('no-heartbeat', [2])
    """
    m = _IP_RECORD.search(text)
    if not m:
        return None
    ranks = sorted(set(int(x) for x in re.findall(r"\d{1,6}", m.group(2))))
    return {"kind": _IP_KIND.get(m.group(1), NO_HEARTBEAT), "culprits": ranks, "summary": _line_at(text, m.start()),
            "interruption": m.group(1)}
