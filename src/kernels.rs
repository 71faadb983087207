//! The CUDA kernels compiled by build.rs from `kernels/*.cu`, embedded in the library.
//!
//! When the library was built without nvcc, [`KERNELS_BUILT`] is false and
//! [`MODULES`] is empty; the CUDA backend then reports "kernels not built".

/// One compiled `kernels/<name>.cu`.
#[derive(Debug, Clone, Copy)]
pub struct KernelModule {
    /// File stem of the source (`copy_blocks` for `kernels/copy_blocks.cu`).
    pub name: &'static str,
    /// Fatbin: sm_80 and sm_90 SASS plus compute_90 PTX (load with cuModuleLoadData).
    pub fatbin: &'static [u8],
    /// PTX for compute_90 (ISA 9.0), for inspection or JIT.
    pub ptx: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The module built from `kernels/<name>.cu`, if the kernels were built.
pub fn module(name: &str) -> Option<&'static KernelModule> {
    MODULES.iter().find(|m| m.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_modules_match_the_build_flag() {
        if KERNELS_BUILT {
            let m = module("copy_blocks").expect("kernels/copy_blocks.cu is compiled");
            assert!(!m.fatbin.is_empty());
            assert!(
                m.ptx.contains(".version 9.0"),
                "PTX ISA must be 9.0 for driver 580"
            );
            assert!(m.ptx.contains("kv_gather") && m.ptx.contains("kv_scatter"));
            let burn = module("bench_burn").expect("kernels/bench_burn.cu is compiled");
            assert!(burn.ptx.contains("kv_bench_burn"));
            assert!(
                NVCC_VERSION.contains("13.0"),
                "nvcc is pinned to 13.0: {NVCC_VERSION}"
            );
        } else {
            assert!(MODULES.is_empty());
            assert!(module("copy_blocks").is_none());
        }
    }
}
