"""The scripts users and the accelerator check run, where the CPU can check them."""
import re
import subprocess

from conftest import REPO


def test_tpu_check_sh_sets_pythonpath_in_every_branch_with_it_unset():
    """tpu_check.sh runs under `set -u`: an export that reads $PYTHONPATH bare dies where it is unset (issue #61
    item 7: line 83, on a machine whose image has its own package index). Each export it makes, run alone under
    `set -u` with PYTHONPATH unset, sets it to its folder; none reads it unguarded."""
    script = (REPO / "scripts" / "tpu_check.sh").read_text()
    assert "set -uo pipefail" in script
    exports = re.findall(r'export PYTHONPATH="[^"]*"', script)
    assert len(exports) >= 3
    for export in exports:
        assert re.fullmatch(r'export PYTHONPATH="\$\{PYTHONPATH:\+\$PYTHONPATH:\}[^$"]+"', export), export
        folder = export.rpartition("}")[2].rstrip('"')
        result = subprocess.run(["bash", "-c", f'set -uo pipefail; unset PYTHONPATH; {export}; echo "$PYTHONPATH"'],
                                capture_output=True, text=True)
        assert result.returncode == 0 and result.stdout.strip() == folder, (export, result.stderr)
    assert not re.search(r'\$PYTHONPATH(?![:}])|\$\{PYTHONPATH\}', script.replace("${PYTHONPATH:+$PYTHONPATH:}", ""))
