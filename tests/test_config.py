import pytest

from gossiploco.config import RunConfig, config_from_dict, load_config, preset_names
from gossiploco.errors import ConfigError

PAPER_PRESETS = {
    "diloco": ("identity", "global", False),
    "localm1m2": ("gossip", "gossip", False),
    "globalm1": ("global", "identity", False),
    "globalm1-localm2": ("global", "gossip", False),
    "globalm1-localm2-subset": ("global", "gossip", False),
    "globalm1s": ("global", "identity", True),
    "globalm1s-localm2": ("global", "gossip", True),
}


def test_every_paper_preset_exists_with_table2_operators():
    assert set(PAPER_PRESETS) | {"sync-dp"} <= set(preset_names())
    for name, (mix1, mix2, state) in PAPER_PRESETS.items():
        cfg = load_config(name)
        assert (cfg.name, cfg.mode, cfg.mix1.kind, cfg.mix2.kind, cfg.mix1.state) == (name, "factored", mix1, mix2, state)
    assert load_config("sync-dp").mode == "sync-dp"


def test_subset_preset_selects_paper_blocks():
    cfg = load_config("globalm1-localm2-subset")
    assert cfg.mix2.blocks == ["embed", "lm_head", "layers.0", "layers.1"]


def test_defaults_match_diloco_outer_optimizer():
    cfg = RunConfig()
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (0.7, 0.9, True)


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"workers": 0}, "workers"),
        ({"mode": "async"}, "mode"),
        ({"mix2": {"kind": "ring"}}, "mix2.kind"),
        ({"mix2": {"blocks": ["layers.99"]}}, "mix2.blocks"),
        ({"mix1": {"blocks": ["nonexistent"]}}, "mix1.blocks"),
        ({"mix2": {"state": True}}, "mix2.state"),
        ({"model": {"size": "huge"}}, "model.size"),
        ({"inner": {"lr": -1.0}}, "inner.lr"),
        ({"inner": {"lr": "fast"}}, "inner.lr"),
        ({"outer": {"momentum": 1.5}}, "outer.momentum"),
        ({"data": {"val_fraction": 0.0}}, "data.val_fraction"),
        ({"monitor": {"every": -1}}, "monitor.every"),
        ({"timeouts": {"exchange_s": 0}}, "timeouts.exchange_s"),
        ({"mix2": {"colour": "red"}}, "mix2.colour"),
        ({"typo_top_level": 1}, "typo_top_level"),
        ({"device": "tpu"}, "device"),
        ({"workers": True}, "workers"),
        ({"compute": {"companion_niceness": 20}}, "compute.companion_niceness"),
        ({"compute": {"companion_niceness": -1}}, "compute.companion_niceness"),
    ],
)
def test_bad_config_names_the_field(raw, field):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")


def test_subset_naming_no_existing_block_is_an_error_with_the_block_list():
    with pytest.raises(ConfigError, match=r"mix2.blocks: no block matches 'layers.7'.*embed"):
        load_config("globalm1-localm2-subset", {"model.size": "tiny", "mix2.blocks": ["embed", "layers.7"]})


def test_overrides_and_unknown_preset(tmp_path):
    cfg = load_config("globalm1", {"workers": 6, "model.size": "small", "rounds": None})
    assert cfg.workers == 6 and cfg.model.size == "small" and cfg.rounds == RunConfig().rounds
    with pytest.raises(ConfigError, match="config: no such file or preset"):
        load_config("no-such-preset")
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = [")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
