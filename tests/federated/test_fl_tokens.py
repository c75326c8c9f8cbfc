"""``distml fl tokens --out``: the tokens file is created readable by its owner only."""

import json
import os
import stat

from conftest import distml_invoke


def test_tokens_out_creates_a_file_only_its_owner_can_read_under_umask_022(tmp_path):
    before = os.umask(0o022)
    try:
        result = distml_invoke("fl", "tokens", "3", "--out", "tokens.json", cwd=tmp_path)
    finally:
        os.umask(before)
    assert result.exit_code == 0, result.stdout
    path = tmp_path / "tokens.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    table = json.loads(path.read_text())
    assert len(table) == 3 and all(len(t) >= 16 for t in table.values())
    assert all(token not in result.stdout for token in table.values())


def test_tokens_out_never_overwrites_a_file(tmp_path):
    (tmp_path / "tokens.json").write_text("keep")
    result = distml_invoke("fl", "tokens", "2", "--out", "tokens.json", cwd=tmp_path)
    assert result.exit_code == 2 and "exists" in result.stderr
    assert (tmp_path / "tokens.json").read_text() == "keep"


def test_tokens_help_says_that_printed_tokens_follow_the_umask(tmp_path):
    result = distml_invoke("fl", "tokens", "--help", cwd=tmp_path)
    assert result.exit_code == 0
    assert "0600" in result.stdout and "umask" in result.stdout


def test_the_server_names_a_tokens_file_that_others_can_read(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"client-0000": "short"}))
    tokens.chmod(0o644)
    result = distml_invoke("fl", "server", "--tokens", str(tokens), cwd=tmp_path)
    assert "open to group or others (mode 0644)" in result.stderr
    assert result.exit_code == 2 and ">= 16 characters" in result.stderr
