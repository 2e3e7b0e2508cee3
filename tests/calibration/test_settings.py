"""Calibration's settings are written once (`CalibrationSchema`): the training run's `calibration:` section, and the
flags of `deepspec calibrate` and `deepspec bench calibration`, built from its fields with their defaults and help."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from deepspec.calibration.config import CalibrationSchema, cli_fields

REQUIRED = ["--drafter", "d", "--cache", "c"]


def parsers():
    from deepspec.benchmarks.calibration import build_parser as bench_parser
    from deepspec.calibration.cli import build_parser

    return {"calibrate": build_parser(), "bench calibration": bench_parser()}


@pytest.mark.parametrize("command", ["calibrate", "bench calibration"])
def test_every_setting_is_a_flag_with_the_schemas_default(command):
    parser = parsers()[command]
    flags = {action.dest: action for action in parser._actions}
    for f in cli_fields(CalibrationSchema):
        assert flags[f.name].option_strings == ["--" + f.name.replace("_", "-")]
        assert flags[f.name].default == f.default and flags[f.name].help == f.metadata.get("help")
    assert "enabled" not in flags  # training's switch, not a flag
    assert CalibrationSchema.from_cli_args(parser.parse_args(REQUIRED)) == CalibrationSchema()


def test_flags_set_the_settings_and_are_checked_as_the_config_is():
    parser = parsers()["calibrate"]
    args = parser.parse_args([*REQUIRED, "--labels", "analytic", "--holdout", "0", "--num-bins", "10",
                              "--max-anchors-per-seq", "200", "--seed", "3"])
    settings = CalibrationSchema.from_cli_args(args)
    assert asdict(settings) == {**asdict(CalibrationSchema()), "labels": "analytic", "holdout": 0.0, "num_bins": 10,
                                "max_anchors_per_seq": 200, "seed": 3}
    with pytest.raises(ValueError, match=r"calibration.holdout=1.5 must lie in \[0, 1\)"):
        CalibrationSchema.from_cli_args(parser.parse_args([*REQUIRED, "--holdout", "1.5"]))
    with pytest.raises(SystemExit):  # argparse refuses a label source it does not know
        parser.parse_args([*REQUIRED, "--labels", "soft"])
