import pytest
import torch

from tendril.cli import main
from tendril.demo import Row, SectionResult, sections


def test_info_prints_versions_and_feature_support(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and torch.__version__ in out
    assert "conditional graph nodes" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_demo_on_cpu_runs_real_cpu_paths_and_says_what_needs_a_gpu(capsys):
    assert main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "No NVIDIA GPU here" in out
    assert "eager PyTorch" in out
    assert "needs an NVIDIA GPU" in out


def test_every_demo_section_measures_something_on_cpu():
    found = sections()
    assert found, "no demo sections found"
    for section in found:
        result = section.run(torch.device("cpu"), True)
        assert result.rows
        assert all(row.ms is None or row.ms > 0 for row in result.rows)


def test_speedup_is_relative_to_the_baseline_row():
    result = SectionResult("t", [Row("a", "", 4.0, baseline=True), Row("b", "", 1.0), Row("c", "", None)])
    assert [result.speedup(r) for r in result.rows] == [1.0, 4.0, None]


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["nope"])


@pytest.mark.parametrize(
    ("device", "said"),
    [("nope", "is not a torch device"), ("meta", "runs on 'cpu' or 'cuda"), ("cuda:99", "CUDA device")],
)
def test_a_device_the_demo_cannot_run_on_is_refused_before_any_section(capsys, device, said):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", device])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --device: '{device}'" in err and said in err


def test_a_failing_demo_section_is_reported_and_the_others_still_run(monkeypatch, capsys):
    import tendril.demo

    def broken(device, quick):
        raise RuntimeError("kernel exploded")

    def working(device, quick):
        return SectionResult("Working section", [Row("fine", "", 1.0, baseline=True)])

    fake = [tendril.demo.DemoSection(0, "Broken section", broken), tendril.demo.DemoSection(1, "Working", working)]
    monkeypatch.setattr(tendril.demo, "sections", lambda: fake)
    assert main(["demo", "--quick", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "Broken section: failed with RuntimeError: kernel exploded" in out
    assert "Working section" in out and "1 demo section(s) failed" in out
