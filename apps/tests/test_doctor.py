"""`yatt doctor` runs the real round trip (tiny model generate -> msgpack -> zero-copy decode) and reports it."""

import json

from yatt_apps.cli.main import main


def test_doctor_round_trip(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] is True
    assert report["round_trip"]["generated_tokens"] == 8
    assert report["round_trip"]["max_logprob_error"] < 1e-4
    assert set(report["packages"]) == {
        "yatt-placement",
        "yatt-rollout",
        "yatt-algos",
        "yatt-multimodal",
        "yatt-controller",
        "yatt-apps",
    }
