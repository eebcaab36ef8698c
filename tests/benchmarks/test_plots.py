import json
import shutil
from pathlib import Path

import pytest

from benchmarks import plots
from benchmarks.__main__ import main

pytest.importorskip("matplotlib")

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(plots.PLOTS))
def test_each_plot_draws_its_committed_results(name, tmp_path):
    if not (RESULTS / f"{name}.json").exists():
        pytest.skip(f"no committed {name} results yet (test_sparse_scaling_case draws synthetic ones)")
    json_path = tmp_path / f"{name}.json"
    shutil.copy(RESULTS / f"{name}.json", json_path)
    png_path = plots.plot_file(json_path)
    assert png_path == tmp_path / f"{name}.png"
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)


def test_a_variant_run_is_drawn_by_its_case(tmp_path):
    json_path = tmp_path / "sparse-cnn-resnet50.json"
    shutil.copy(RESULTS / "archive" / "sparse-cnn-resnet50.json", json_path)
    assert plots.plot_file(json_path) == tmp_path / "sparse-cnn-resnet50.png"


def test_a_case_without_a_plot_draws_nothing(tmp_path):
    json_path = tmp_path / "control-flow.json"
    shutil.copy(RESULTS / "control-flow.json", json_path)
    assert plots.plot_file(json_path) is None
    assert not (tmp_path / "control-flow.png").exists()


def test_plot_command_redraws_from_a_results_folder(tmp_path, capsys):
    shutil.copy(RESULTS / "generation.json", tmp_path / "generation.json")
    assert main(["plot", "generation", "--results", str(tmp_path)]) == 0
    assert (tmp_path / "generation.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no results file"):
        main(["plot", "graphs-memory", "--results", str(tmp_path)])


def test_plot_command_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    (tmp_path / "generation.json").write_text(json.dumps({"case": "generation"}))
    assert main(["plot", "generation", "--results", str(tmp_path)]) == 1
    assert "pip install tendril[bench]" in capsys.readouterr().out
