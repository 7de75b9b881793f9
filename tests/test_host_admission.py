"""`HostAdmission`: a kind of entry whose recent moves to the host tier were all wasted (none
restored before leaving) is moved there only one time in PROBE; one restore and it is moved
again every time; kinds are learnt apart."""

from __future__ import annotations

from pdserve.engine.host_admission import PROBE, WINDOW, HostAdmission


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
