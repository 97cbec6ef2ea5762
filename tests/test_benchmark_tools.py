"""How ``benchmarks/compile_check.py`` reads a kernel's SASS: the integer work between wgmma (HGMMA) issues."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compile_check import wgmma_loops  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_7:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x2f000], R4 ;
        /*0020*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/                   LOP3.LUT R2, R2, R3, RZ, 0x3c, !PT ;
        /*0040*/                   IMAD R4, R4, R5, RZ ;
        /*0050*/                   SHF.R.U32.HI R6, RZ, 0x10, R4 ;
        /*0060*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR10], R24, gsb0 ;
        /*0070*/               @P1 BRA `(.L_x_7) ;
.L_x_8:
        /*0080*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0090*/               @P2 BRA `(.L_x_8) ;
        /*00a0*/                   EXIT ;
"""


def test_wgmma_loops_reports_the_integer_work_between_hgmma_issues():
    # One loop issues two HGMMAs with three integer instructions between them (what delays the tensor cores);
    # the other loop issues none and is not reported.
    assert wgmma_loops(SASS) == [{"instructions": 7, "hgmma": 2, "integer": 3, "max_gap": 3}]
