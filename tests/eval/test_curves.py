"""AUC against hand-computed values, comparisons over a common range, the tables and plots of curves."""

from __future__ import annotations

import math

import pytest

from elastic_pretrain.eval.curves import CurvePoint, QualityCurve, auc, compare
from elastic_pretrain.eval.report import comparison_table, markdown_table, plot_comparison


def test_auc_hand_computed():
    assert auc([0.5, 1.0], [2.0, 1.0]) == pytest.approx(1.5, abs=1e-12)
    # non-uniform spacing: (0.25·2.5 + 0.5·1.75) / 0.75
    assert auc([0.25, 0.5, 1.0], [3.0, 2.0, 1.5]) == pytest.approx(2.0, abs=1e-12)
    # order of the points does not matter
    assert auc([1.0, 0.25, 0.5], [1.5, 3.0, 2.0]) == pytest.approx(2.0, abs=1e-12)
    # one point, and all points at one compute: the (mean) loss there
    assert auc([0.7], [2.5]) == 2.5
    assert auc([0.5, 0.5], [1.0, 3.0]) == 2.0
    # equal-compute points are averaged before integrating: (0,1),(0,3)->(0,2); (2,0)
    assert auc([0.0, 0.0, 2.0], [1.0, 3.0, 0.0]) == pytest.approx(1.0, abs=1e-12)
    # a sub-range interpolates at its ends: line (0,0)-(1,2) over [0.5, 1] averages 1.5
    assert auc([0.0, 1.0], [0.0, 2.0], lo=0.5, hi=1.0) == pytest.approx(1.5, abs=1e-12)
    assert auc([0.0, 1.0], [0.0, 2.0], lo=0.25, hi=0.25) == pytest.approx(0.5, abs=1e-12)
    for bad in (([], []), ([0.5], [1.0, 2.0]), ([0.5, math.nan], [1.0, 2.0])):
        with pytest.raises(ValueError):
            auc(*bad)
    with pytest.raises(ValueError, match="not inside"):
        auc([0.5, 1.0], [1.0, 1.0], lo=0.1)


def _curve(name: str, pts: list[tuple[float, float]]) -> QualityCurve:
    return QualityCurve(
        name=name, points=tuple(CurvePoint(loops=i + 1, relative_compute=c, loss=v) for i, (c, v) in enumerate(pts))
    )


def test_compare_uses_the_common_range_and_plots(tmp_path):
    a = _curve("a", [(0.25, 3.0), (0.5, 2.0), (1.0, 1.0)])
    b = _curve("b", [(0.5, 1.8), (1.0, 1.2)])
    png = tmp_path / "cmp.png"
    result = plot_comparison([a, b], png)
    assert result == compare([a, b])
    assert (result.lo, result.hi) == (0.5, 1.0)
    assert result.aucs == pytest.approx((1.5, 1.5), abs=1e-12)  # a over [0.5, 1]: (2+1)/2
    assert result.relative == pytest.approx((0.0, 0.0), abs=1e-12)
    c = _curve("c", [(0.5, 1.2), (1.0, 0.6)])
    assert compare([a, c]).relative[1] == pytest.approx(0.9 / 1.5 - 1, abs=1e-12)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| b | 1.5000 | +0.00% |" in comparison_table(result)
    with pytest.raises(ValueError, match="share no compute range"):
        compare([_curve("x", [(0.1, 1.0), (0.2, 1.0)]), _curve("y", [(0.5, 1.0), (1.0, 1.0)])])


def test_markdown_table():
    text = markdown_table(
        QualityCurve(
            name="m",
            flops_max=1000.0,
            points=(
                CurvePoint(loops=2, relative_compute=1.0, loss=1.0),
                CurvePoint(loops=1, relative_compute=0.5, loss=2.0),
            ),
        )
    )
    lines = text.splitlines()
    assert lines[4] == f"| 1 | 500 | 0.500 | 2.0000 | {math.exp(2):.3f} |"  # sorted by compute
    assert lines[5].startswith("| 2 | 1,000 | 1.000 | 1.0000 |")
    assert "AUC (compute-averaged loss over [0.500, 1.000]): 1.5000" in text
