"""``speedtronic compare`` CLI errors (compare/command.py): exit code 2 naming the key or preset."""

from __future__ import annotations

from speedtronic.cli import main


# ------------------------------------------------------------------------------ CLI errors
def test_unknown_variant_key_exits_2_naming_the_key(tiny_yaml, tmp_path, capsys):
    rc = main(["compare", "--config", str(tiny_yaml), "--variant", "adamw", "--variant",
               "mine:optimizer.muon_lrr=0.05", "--output-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("speedtronic: error: --variant mine: unknown config key "
                          "'optimizer.muon_lrr'") and "optimizer.muon_lr" in err
    assert not (tmp_path / "c" / "runs").exists()  # validated before any training


def test_an_output_dir_that_cannot_be_created_names_the_option(tiny_yaml, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    rc = main(["compare", "--config", str(tiny_yaml), "--output-dir", str(tmp_path / "afile")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("speedtronic: error: --output-dir: cannot create"), err


def test_unknown_preset_exits_2_listing_presets(tiny_yaml, tmp_path, capsys):
    rc = main(["compare", "--config", str(tiny_yaml), "--variant", "lion",
               "--output-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "'lion': unknown preset; presets: adamw, muon, muon_plus, cautious_adamw, " \
           "cautious_muon" in err


def test_an_empty_output_dir_is_refused(tiny_yaml, tmp_path, capsys, monkeypatch):
    """--output-dir= once wrote every run into the working directory."""
    monkeypatch.chdir(tmp_path)
    rc = main(["compare", "--config", str(tiny_yaml), "--output-dir="])
    assert rc == 2 and "--output-dir: empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.yaml"]


def test_lr_factors_must_be_finite_and_not_empty(tiny_yaml, tmp_path, capsys):
    """inf was blamed on optimizer.lr ("expected float, got str 'inf'"); an empty list ran
    the default factors without a word."""
    base = ["compare", "--config", str(tiny_yaml), "--variant", "adamw", "--lr-sweep",
            "--output-dir", str(tmp_path / "c")]
    for factors, said in (("inf,1", "--lr-factors: need finite positive numbers"),
                          ("1e400", "--lr-factors: need finite positive numbers"),
                          ("", "--lr-factors: expected comma-separated numbers"),
                          (",", "--lr-factors: expected comma-separated numbers")):
        capsys.readouterr()
        try:
            rc = main([*base, f"--lr-factors={factors}"])
        except SystemExit as exc:  # argparse's own error exit
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2 and said in err and "optimizer.lr" not in err, (factors, err)
    assert not (tmp_path / "c" / "runs").exists()
