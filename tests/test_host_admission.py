"""`HostAdmission`: a kind of entry whose recent moves to the host tier were all wasted (none
restored before leaving) is moved there only one time in PROBE; one restore and it is moved
again every time; kinds are learnt apart."""

from __future__ import annotations

from pdserve.engine.host_admission import PROBE, WINDOW, HostAdmission
from pdserve.engine.prefix_index import CacheEntry, EntryIndex


def test_wasted_moves_throttle_a_kind_until_one_pays_off() -> None:
    admission = HostAdmission()
    assert all(admission.admits("decode") for _ in range(3 * WINDOW))  # nothing learnt yet
    for _ in range(WINDOW - 1):
        admission.left("decode", restored=False)
    assert admission.admits("decode")  # a window not yet full
    admission.left("decode", restored=False)
    admitted = [admission.admits("decode") for _ in range(4 * PROBE)]
    assert sum(admitted) == 4 and admitted[PROBE - 1]  # a probe every PROBE entries
    assert admission.admits("end")  # another kind: its own window
    admission.left("decode", restored=True)  # a probe paid off
    assert all(admission.admits("decode") for _ in range(2 * PROBE))
    for _ in range(WINDOW):  # the restore slides out of the window: throttled again
        admission.left("decode", restored=False)
    assert not admission.admits("decode")


def test_a_probe_is_not_the_first_the_host_tier_evicts() -> None:
    """Never-reused generations' entries leave the host tier first, but not a probe: it must live
    long enough to be restored, or its kind could never be admitted again."""
    index = EntryIndex()
    probe, plain = (
        CacheEntry(bytes([i]), bytes([i]), (), 64, [], i, [], kind="decode", tier="host", probe=i == 0)
        for i in range(2)
    )
    index.add(probe)  # the older of the two
    index.add(plain)
    assert index.victim(None, only_unused=False, tier="host") is plain
    admission = HostAdmission()
    for _ in range(WINDOW):
        admission.left("decode", restored=False)
    assert admission.throttled("decode") and not admission.throttled("end")
