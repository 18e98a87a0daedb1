"""bench/ab.py refuses an interpreter whose vfab is not the checkout it is said to be (the A/B would compare
the wrong code: an editable install follows whichever tree last bootstrapped that venv)."""

from __future__ import annotations

import os
import sys

import pytest

from bench import ab

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_this_interpreter_is_this_tree():
    ab.check_tree(sys.executable, HERE)


def test_an_interpreter_of_another_tree_is_refused_naming_both(tmp_path):
    with pytest.raises(SystemExit, match=f"imports vfab from {HERE}/vfab, not from {tmp_path}: re-install it"):
        ab.check_tree(sys.executable, str(tmp_path))
