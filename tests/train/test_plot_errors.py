"""``speedtronic plot`` on damaged metrics files and awkward output paths: clear errors, exit 2,
and the path it reports is the file it wrote."""

from __future__ import annotations

import json

import pytest

from speedtronic.cli import main
from speedtronic.errors import SpeedtronicError
from speedtronic.train.plot import plot_runs

pytest.importorskip("matplotlib")


def _run(path, extra: bytes = b""):
    path.mkdir(parents=True)
    lines = [{"event": "train_step", "step": i, "loss": 3.0 - i / 10} for i in range(1, 4)]
    (path / "metrics.jsonl").write_bytes(
        b"".join(json.dumps(r).encode() + b"\n" for r in lines) + extra)
    return path


def test_list_and_non_utf8_lines_are_skipped_and_the_plot_is_written(tmp_path, capsys):
    run = _run(tmp_path / "a", b"[1, 2]\n\xff\xfe\n")
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'loss.png'}" in out and "line 4: a JSON list" in out
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_non_integer_step_names_the_file_and_line(tmp_path, capsys):
    run = _run(tmp_path / "a", b'{"event": "train_step", "step": "x", "loss": 1.0}\n')
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (f"speedtronic: error: {run / 'metrics.jsonl'}: line 4: a train_step record "
                   "needs an integer 'step', got 'x'\n")
    assert not (run / "loss.png").exists()


def test_an_existing_directory_as_output_gets_loss_png_inside(tmp_path, capsys):
    run = _run(tmp_path / "runs" / "base")
    assert main(["plot", str(run), "-o", str(tmp_path / "runs")]) == 0
    written = tmp_path / "runs" / "loss.png"
    assert capsys.readouterr().out == f"wrote {written}\n"
    assert written.read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "runs.png").exists()
    # a path ending in a separator is a directory too, created on demand
    assert plot_runs([run], f"{tmp_path / 'new'}/") == tmp_path / "new" / "loss.png"
    assert (tmp_path / "new" / "loss.png").is_file()


def test_the_reported_path_is_the_file_written(tmp_path):
    run = _run(tmp_path / "a")
    out = plot_runs([run], tmp_path / "cmp")  # no suffix: matplotlib appends .png
    assert out == tmp_path / "cmp.png" and out.is_file() and not (tmp_path / "cmp").exists()
    assert plot_runs([run], tmp_path / "c.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_a_non_image_output_is_refused_and_left_untouched(tmp_path):
    run = _run(tmp_path / "a")
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(SpeedtronicError, match=r"'\.jsonl' is not an image type"):
        plot_runs([run], run / "metrics.jsonl")
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_an_output_under_a_file_names_the_file(tmp_path, capsys):
    from speedtronic.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "train_step", "step": 1, "loss": 2.0}\n')
    a_file = tmp_path / "base.yaml"
    a_file.write_text("run: {}\n")
    assert main(["plot", str(run), "-o", str(a_file / "x.png")]) == 2
    assert f"{a_file} is a file" in capsys.readouterr().err
    assert a_file.read_text() == "run: {}\n"


def test_a_single_logged_step_is_drawn_as_a_marker(tmp_path, monkeypatch):
    """One train_step row draws no line segment: it needs a marker to be visible at all."""
    import matplotlib.axes

    calls = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        calls.append((len(args[0]), kwargs.get("marker")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    one = tmp_path / "one"
    one.mkdir()
    (one / "metrics.jsonl").write_text(json.dumps({"event": "train_step", "step": 20,
                                                   "loss": 2.5}) + "\n")
    plot_runs([one, _run(tmp_path / "many")])
    assert (1, "o") in calls and (3, None) in calls


def test_a_compare_output_folder_plots_its_runs(tmp_path, capsys, monkeypatch):
    """It was refused as "not a run directory"; it stands for the runs compare wrote."""
    folder = tmp_path / "cmp"
    for name in ("muon-seed0", "adamw-seed0"):
        _run(folder / "runs" / name)
    drawn: list[str] = []
    import speedtronic.train.plot as plot

    real = plot._curves
    monkeypatch.setattr(plot, "_curves", lambda d: drawn.append(d.name) or real(d))
    assert main(["plot", str(folder)]) == 0
    assert capsys.readouterr().out == f"wrote {folder / 'loss.png'}\n"
    assert drawn == ["adamw-seed0", "muon-seed0"]
