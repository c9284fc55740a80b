"""conf/ is the single source of configuration: params.yaml must be its composition."""

from __future__ import annotations

import yaml

from pipeline.compose import ROOT, compose_params


def test_params_yaml_is_composed_from_conf():
    committed = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert committed == compose_params(), (
        "params.yaml is out of sync with conf/: run `python -m pipeline.compose`"
    )


def test_overrides_compose():
    params = compose_params(["eval.windows=1", "capture.token_budget=128"])
    assert params["eval"]["windows"] == 1 and params["capture"]["token_budget"] == 128
    assert list(params["models"]) == ["smollm2-135m"]


def test_dvc_config_is_offline_and_uses_hydra():
    text = (ROOT / ".dvc" / "config").read_text()
    assert "analytics = false" in text and "check_update = false" in text
    assert "enabled = true" in text and "config_dir = conf" in text


def test_every_calibrated_method_has_its_conf_group_and_stage():
    """Each calibrated method's conf group states exactly the library's defaults (so the
    pipeline's artifact is the library's default artifact), and dvc.yaml has its stage."""
    from veloxquant.methods import CALIBRATED, METHODS

    params = compose_params()
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in CALIBRATED:
        conf = dict(params["method"][name])
        conf.pop("variants", None)
        assert conf == dict(METHODS[name].defaults), name
        assert stages[name]["do"]["cmd"] == f"python -m pipeline.calibrate {name} ${{key}}"
        assert f"artifacts/${{key}}/methods/{name}" in stages["bundle"]["do"]["deps"]
        outs = [f"artifacts/${{key}}/methods/{name}", f"artifacts/${{key}}/ablations/{name}"]
        assert stages[name]["do"]["outs"] == outs
        assert outs[1] in stages["evaluate"]["do"]["deps"]


def test_default_and_full_experiment_rows_point_at_trained_variants():
    """Every eval row's ablation bundle is one its composition trains, and the full experiment
    (every README table) is a superset of the default pipeline on a second model family."""
    default, full = compose_params(), compose_params(["+experiment=full"])
    assert list(full["models"]) == ["smollm2-135m", "smollm2-135m-kvbias"]
    # the stress model's knobs are write_kv_bias_model's, as the import stage passes them
    import inspect

    from pipeline.import_model import STRESS_KEYS
    from veloxquant.stress import write_kv_bias_model

    stress = full["models"]["smollm2-135m-kvbias"]["stress"]
    assert set(stress) <= set(STRESS_KEYS) <= set(inspect.signature(write_kv_bias_model).parameters)
    for params in (default, full):
        names = [r["name"] for r in params["eval"]["rows"]]
        assert len(set(names)) == len(names)
        for row in params["eval"]["rows"]:
            path = row.get("artifact_dir", "")
            if path.startswith("ablations/"):
                _, method, variant = path.split("/")
                assert variant in params["method"][method]["variants"], row
    assert {r["name"] for r in default["eval"]["rows"]} < {r["name"] for r in full["eval"]["rows"]}
    # every calibrated method keeps its uncalibrated twin in the default rows
    default_names = {r["name"] for r in default["eval"]["rows"]}
    for method in ("qfilters-25%", "vecinfer", "commvq-2bit", "ratequant-3"):
        twin = "ratequant-3-uniform" if method == "ratequant-3" else f"{method}-uncalibrated"
        assert {method, twin} <= default_names
