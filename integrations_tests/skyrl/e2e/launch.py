"""``python launch.py <overrides>``: the stablerl SkyRL entry point (``stablerl.adapters.skyrl.main``) with the
end-to-end test's stand-ins (:mod:`skyrl_e2e`) and a local Ray cluster declaring one GPU as a scheduling label
(SkyRL's placement groups ask for GPU bundles; the CPU shim maps the device to the CPU)."""

import functools
import sys

import ray

if __name__ == "__main__":
    ray.init = functools.partial(ray.init, num_cpus=4, num_gpus=1, include_dashboard=False)
    from skyrl_e2e import E2EExp

    from stablerl.adapters.skyrl.main import main

    main(sys.argv[1:], exp_class=E2EExp)
