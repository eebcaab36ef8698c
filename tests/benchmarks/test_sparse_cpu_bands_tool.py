"""The `sparse_cpu_bands` tool: a quick run times every split of each direct-kernel layer, the plan's first, and
checks their outputs bit-identical (no speed-up is asserted: CI machines have two cores shared with other jobs)."""

import json

import pytest

pytest.importorskip("numba")


def test_a_quick_run_times_the_plans_split_and_more_bands_for_each_direct_layer(tmp_path):
    from benchmarks.tools import sparse_cpu_bands as tool

    report = tool.main(["--out", str(tmp_path), "--quick", "--threads", "1,2"])
    assert json.loads((tmp_path / "sparse_cpu_bands.json").read_text()) == json.loads(json.dumps(report))
    assert report["threads"] == [2]
    timed = [layer for layer in report["layers"] if layer["threads"]["2"]]
    assert timed, "some representative convolution runs the direct kernel on 2 threads"
    asked = {max(1, round(f * 2)) for f in tool.BAND_FACTORS}
    for layer in timed:
        rows = layer["threads"]["2"]
        assert rows[0]["split"] == "the plan's" and len(rows) == 1 + len(asked)
        assert max(row["bands"] for row in rows) > rows[0]["bands"] or rows[0]["bands"] >= 4
        assert all(row["alone_us"]["median"] > 0 and row["after_before_us"]["median"] > 0 for row in rows)
    markdown = (tmp_path / "sparse_cpu_bands.md").read_text()
    assert all(f"`{layer['layer']}`" in markdown for layer in report["layers"])


def test_thread_counts_of_one_alone_and_malformed_ones_are_refused(tmp_path):
    from benchmarks.tools import sparse_cpu_bands as tool

    with pytest.raises(ValueError, match="none above 1"):
        tool.main(["--out", str(tmp_path), "--quick", "--threads", "1"])
    with pytest.raises(ValueError, match="at least 1"):
        tool.main(["--out", str(tmp_path), "--quick", "--threads", "2,x"])
