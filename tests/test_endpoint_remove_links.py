"""`pipelines remove` and the model folders it leaves: a symbolic link is never removed, and the
command says which ones it left, by name (issue 43). Its place is beside the other commands'
tests (test_cli.py); it lives here while that file is another engineer's."""

from __future__ import annotations

import os

from pipelines.cli import main
from pipelines.examples.basic import make_chain


def test_remove_names_the_linked_model_folders_it_leaves(tmp_path, capsys):
    repo, elsewhere = tmp_path / "model_repository", tmp_path / "elsewhere"
    chain = make_chain(name="chain")
    chain.compile("both").write(repo)
    chain.compile("fused").write(elsewhere)  # a model of the pipeline kept in another folder, linked in
    (fused,) = [name for name in os.listdir(elsewhere) if not name.startswith(".") and (elsewhere / name).is_dir()]
    os.symlink(elsewhere / fused, repo / "chain_fused")
    os.symlink(elsewhere / fused, repo / "other_model")  # named otherwise: known by the marker it holds
    (tmp_path / "unrelated").mkdir()
    os.symlink(tmp_path / "unrelated", repo / "unrelated")  # not the pipeline's: not listed

    assert main(["remove", str(repo), "chain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("removed ")
    assert "left 2 symbolically linked model folders of 'chain'" in out
    assert f"  chain_fused -> {elsewhere / fused}" in out and f"  other_model -> {elsewhere / fused}" in out
    assert "unrelated" not in out
    assert (repo / "chain_fused").is_symlink() and (elsewhere / fused).is_dir()  # left as they were


def test_remove_says_nothing_of_links_when_there_are_none(tmp_path, capsys):
    repo = tmp_path / "model_repository"
    make_chain(name="chain").compile("both").write(repo)
    assert main(["remove", str(repo), "chain"]) == 0
    assert "symbolically linked" not in capsys.readouterr().out

