"""Triton kernels for LLM inference: one module per kernel (a package where a kernel has several
implementations), each with its :class:`KernelSpec`, registered on import and discovered by the registry.

The spec contract, the registry, the checks and the launch machinery live one floor down, in
:mod:`tritune.kernels.runtime`; their public names are re-exported here (``tritune.kernels.KernelSpec``).
"""
from tritune.kernels.runtime.spec import (REGISTRY, BucketConfigs, Case, Cost, KernelSpec, PlanCache,  # noqa: F401
                                          Space, all_specs, bucket_key, clear_config_cache, CONFIG_CACHE,
                                          fp32_accumulation, fp32_precision, get, precision_key, register,
                                          set_tune_on_miss, store_dtype)
from tritune.kernels.runtime.checks import (BLOCK_SIZES, check_device, check_fusions, check_no_alias,  # noqa: F401
                                            aligned, check_out, check_tensor, check_vec, extent, is_block_size,
                                            kernel_device, span, tensor_meta)
from tritune.kernels.runtime.hostmath import cdiv, next_power_of_2  # noqa: F401
from tritune.kernels.runtime.launch import (DIRECT_LAUNCH, PDL, PDL_KERNELS, Counters,  # noqa: F401
                                            DescriptorMaker, Workspace, constexpr_params, keepable,
                                            launch_cached, launch_direct, launch_variants, num_sms, pdl, pdl_forced, pdl_now,
                                            sdpa_backend)
