"""bench.memory_skip: the C reader builds, reads the runs it is asked to, and the driver
refuses bad arguments (the figures themselves are the machine's, not tested)."""

from __future__ import annotations

import shutil

import pytest

from bench import memory_skip

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler")


@needs_cc
def test_a_small_run_reports_each_size_and_fraction():
    rows = memory_skip.measure(64, 1, 1, (1024, 4096), (0.5, 1.0))
    assert [r["run_bytes"] for r in rows] == [1024, 1024, 4096, 4096]
    # the kept fraction is the realized one of a random draw
    assert [r["kept"] for r in rows] == pytest.approx([0.5, 1.0, 0.5, 1.0], abs=0.02)
    for r in rows:
        assert r["all_gb_per_s"] > 0 and r["speedup"] > 0
        assert r["ideal"] == pytest.approx(1 / r["kept"], rel=0.02)


@pytest.mark.parametrize("args, says", [(["--runs", "100"], "multiples of 128"),
                                         (["--keep", "0"], "kept fractions"),
                                         (["--buffer-mib", "8"], "--buffer-mib")])
def test_bad_arguments_are_refused(capsys, args, says):
    with pytest.raises(SystemExit):
        memory_skip.main(args)
    assert says in capsys.readouterr().err
