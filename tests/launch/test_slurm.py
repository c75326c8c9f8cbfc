"""A node's place in a Slurm job step, from the environment srun sets (the two-host run under a
faked Slurm environment is in test_multinode.py)."""

from __future__ import annotations

import pytest

from distml.cli.main import assignments_of, resolve_run_config
from distml.config import ConfigError
from distml.launch.slurm import expand_hostlist, slurm_settings


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # the lower bound's width pads
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("login,gpu[1-2],cpu-[009-010]", ["login", "gpu1", "gpu2", "cpu-009", "cpu-010"]),
        ("10.0.0.[1,2]", ["10.0.0.1", "10.0.0.2"]),
        ("rack[1-2]-n[1]", ["rack1-n1", "rack2-n1"]),
    ],
)
def test_a_compact_node_list_expands_as_scontrol_show_hostnames_does(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "a[1-", "a]", "a[x]", "a[3-1]", "a[[1]]", "a[0-9999999]"])
def test_a_malformed_node_list_is_one_config_error(text):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(text)


SRUN = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
}


def test_srun_places_the_node_and_flags_have_the_last_word():
    cfg = resolve_run_config(None, slurm_settings(SRUN) + assignments_of({"nproc": 4}, []))
    assert (cfg.min_nodes, cfg.max_nodes, cfg.node_rank) == (2, 2, 1)
    assert (cfg.rdzv_endpoint, cfg.world_size, cfg.rdzv_id) == ("gpu07:29400", 8, "slurm-77")
    own_id = assignments_of({"rdzv_id": "mine"}, [])
    assert resolve_run_config(None, slurm_settings(SRUN) + own_id).rdzv_id == "mine"
    port = slurm_settings({**SRUN, "MASTER_PORT": "6000"})
    assert dict(port)["rdzv_endpoint"] == "gpu07:6000"
    flags = assignments_of({"rdzv_endpoint": "head:1234"}, [])
    assert resolve_run_config(None, slurm_settings(SRUN) + flags).rdzv_endpoint == "head:1234"


def test_outside_srun_or_on_one_node_slurm_changes_nothing():
    assert slurm_settings({}) == []
    assert slurm_settings({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "a[1-2]"}) == []  # sbatch
    assert slurm_settings({**SRUN, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}) == []
    assert dict(slurm_settings({**SRUN, "SLURM_NNODES": "3"}))["max_nodes"] == 3  # a step's own
