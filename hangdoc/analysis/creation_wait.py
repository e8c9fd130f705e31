"""Every rank in the same ``new_group`` call, and none of them gets out: the groups differ.

``new_group`` is a rendezvous of the whole job on the store under the new group's name, and that
name is the number of groups the rank created before (torch's group counter). When every rank sits
in the same ``new_group`` call and it does not return, they are not meeting under one name: some
rank created a group the others did not (or skipped one) before this call. That is a
**collective-mismatch** of the group creations, not a wait below Python; the stacks cannot say which
rank's count differs (the recorder's ``new_group`` records can).

    >>> from hangdoc.analysis.signatures import Wait
    >>> from hangdoc.model import Frame
    >>> f = finding("ranks 0-3", Wait("collective", "new_group", None, Frame("save", "train.py", 38)))
    >>> f.kind, f.culprits, f.summary.split(":")[0]
    ('collective-mismatch', [], 'every rank waits in new_group at save (train.py')
"""

from __future__ import annotations

from typing import Optional

from hangdoc.analysis.signatures import Wait
from hangdoc.analysis.stack_words import _RECORDS_ADVICE
from hangdoc.model import Finding

#: above a collective-wait's 0.6: the rendezvous of group creation is not a network wait
CONFIDENCE = 0.65


def finding(who: str, w: Wait) -> Optional[Finding]:
    """The finding for ranks ``who``, all waiting at ``w``, when ``w`` is a group creation."""
    if w.op != "new_group":
        return None
    return Finding(
        "collective-mismatch",
        f"every rank waits in {w.describe()}: all of them reached it, so they are creating groups under "
        "different names (a group's name is the count of groups created before it): some rank created a "
        "group the others did not, or skipped one, before this call (the stacks cannot say which)",
        [],
        [f"{who}: {w.describe()}"],
        ["Look before this line for `new_group`, `new_subgroups` or DeviceMesh calls under a rank-dependent "
         "condition (`if rank in ...`): every rank must call `new_group` for every group, members or not, in "
         "the same order.",
         _RECORDS_ADVICE],
        CONFIDENCE,
    )
