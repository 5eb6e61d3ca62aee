"""The demo says which versions it ran with and whether the recorded numbers apply (issue 30, item 4)."""

from stablerl.tools.demo import task


def test_same_versions_say_the_record_applies():
    env = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "trl": "1.16.0", "cpu_kernels": "AVX2"}
    lines = task.version_lines(env)
    assert lines[0] == "versions: torch 2.13.0+cpu, transformers 5.24.0, trl 1.16.0, cpu_kernels AVX2"
    assert "same versions as the recorded runs" in lines[1]


def test_other_versions_are_named_and_the_verdict_is_this_runs():
    env = {"torch": "2.14.1", "transformers": "5.25.0", "trl": "1.16.0", "cpu_kernels": "AVX512"}
    line = task.version_lines(env)[1]
    assert line.startswith("recorded with torch 2.13.0, transformers 5.24.0, trl 1.16.0, cpu_kernels AVX2")
    assert "torch (2.14.1)" in line and "transformers (5.25.0)" in line and "cpu_kernels (AVX512)" in line
    assert "trl (" not in line and "the verdict below is from this run" in line


def test_releases_measured_alike_say_the_record_applies_and_only_those():
    recorded = {"torch": "2.13.0", "transformers": "5.24.0", "trl": "1.16.0", "cpu_kernels": "AVX512"}
    same = ({"torch": "2.15.0", "transformers": "5.25.0"},)
    env = {"torch": "2.15.0+cu132", "transformers": "5.25.0", "trl": "1.16.0", "cpu_kernels": "AVX512"}
    line = task.version_lines(env, recorded, same)[1]
    assert "yours (torch 2.15.0+cu132, transformers 5.25.0) were measured to give the same numbers" in line
    # other kernels, or a release not measured, still say the numbers will differ
    # (torch 2.15.0 with the recorded transformers 5.24.0: that pair was not measured)
    for change in ({"cpu_kernels": "AVX2"}, {"torch": "2.14.1"}, {"transformers": "5.24.1"}, {"transformers": "5.24.0"}):
        line = task.version_lines({**env, **change}, recorded, same)[1]
        assert "numbers will differ" in line and "measured" not in line, change


def test_environment_reads_this_process():
    import torch

    env = task.environment()
    assert env["torch"] == torch.__version__ and env["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
