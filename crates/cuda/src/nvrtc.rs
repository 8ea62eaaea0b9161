//! The kernel sources, their compile options, NVRTC and the on-disk cache of compiled modules.

use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use q4moe_model::backend::KvType;

use crate::{CudaError, Result};

/// Kernel sources, one file per op family; compiled as one program behind `common.cuh` (the
/// shared plumbing) and `quant.cuh` (the quantised dots).
pub(crate) const SOURCES: [(&str, &str); 12] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("quant.cuh", include_str!("../kernels/quant.cuh")),
    ("matvec.cu", include_str!("../kernels/matvec.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    (
        "attention_tc.cu",
        include_str!("../kernels/attention_tc.cu"),
    ),
    ("moe.cu", include_str!("../kernels/moe.cu")),
    ("sample.cu", include_str!("../kernels/sample.cu")),
    ("greedy.cu", include_str!("../kernels/greedy.cu")),
    ("probe.cu", include_str!("../kernels/probe.cu")),
    // Last, so the decode kernels' code keeps its place in the module.
    ("prefill.cu", include_str!("../kernels/prefill.cu")),
    (
        "prefill_attn.cu",
        include_str!("../kernels/prefill_attn.cu"),
    ),
    ("batch_rows.cu", include_str!("../kernels/batch_rows.cu")),
];

/// What a compile depends on besides the sources.
pub(crate) struct Build<'a> {
    pub arch: (i32, i32),
    pub kv_type: KvType,
    /// Read the sources from here instead of the embedded copies (CudaOptions::kernel_dir).
    pub kernel_dir: Option<&'a Path>,
    pub cache_dir: PathBuf,
}

/// Options every compile uses; part of the cache key.
fn compile_options((maj, min): (i32, i32), kv_type: KvType) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture=sm_{maj}{min}"),
        "-default-device".into(),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    if kv_type == KvType::F16 {
        opts.push("-DKV_F16".into()); // attention.cu's kv_t
    }
    if cfg!(feature = "timeline") {
        opts.push("-DQ4MOE_TIMELINE".into()); // common.cuh's launch timeline probe
    }
    opts
}

/// The kernel sources in SOURCES order: the embedded ones, or where `dir` is given the files
/// of the same names there. That lets one binary time several kernel variants in one device
/// call (dev/kernel-variants.sh).
fn kernel_sources(dir: Option<&Path>) -> Result<Vec<(&'static str, String)>> {
    let Some(dir) = dir else {
        return Ok(SOURCES.iter().map(|&(n, s)| (n, s.to_string())).collect());
    };
    SOURCES
        .iter()
        .map(|&(n, _)| {
            let path = dir.join(n);
            match std::fs::read_to_string(&path) {
                Ok(s) => Ok((n, s)),
                Err(source) => Err(CudaError::KernelSource { path, source }),
            }
        })
        .collect()
}

/// FNV-1a over sources, architecture and options: a cubin is reused only for the same inputs.
fn source_hash(sources: &[(&str, String)], opts: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        b.iter()
            .for_each(|&x| h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
    };
    sources.iter().for_each(|(n, s)| {
        eat(n.as_bytes());
        eat(s.as_bytes());
    });
    opts.iter().for_each(|o| eat(o.as_bytes()));
    h
}

/// The cubin for `b`: from the disk cache, else compiled by NVRTC and stored.
pub(crate) fn compiled_module(b: &Build) -> Result<Vec<u8>> {
    let opts = compile_options(b.arch, b.kv_type);
    let sources = kernel_sources(b.kernel_dir)?;
    let (maj, min) = b.arch;
    let path = b.cache_dir.join(format!(
        "q4moe-{:016x}-sm{maj}{min}.cubin",
        source_hash(&sources, &opts)
    ));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let cubin = nvrtc_compile(&sources, &opts)?;
    if std::fs::create_dir_all(&b.cache_dir).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}

fn nvrtc_compile(sources: &[(&str, String)], opts: &[String]) -> Result<Vec<u8>> {
    let src: String = sources
        .iter()
        .map(|(n, s)| format!("// ---- {n}\n{s}\n"))
        .collect();
    let c_src = std::ffi::CString::new(src)
        .map_err(|_| CudaError::Compile("a kernel source holds a NUL byte".into()))?;
    let name = std::ffi::CString::new("q4moe_kernels.cu").expect("no NUL");
    let prog = nvrtc::create_program(&c_src, Some(&name))
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    // SAFETY: `prog` is live until destroyed below.
    unsafe {
        let res = nvrtc::compile_program(prog, opts);
        if res.is_err() {
            let log = nvrtc::get_program_log(prog)
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>());
            let _ = nvrtc::destroy_program(prog);
            return Err(CudaError::Compile(log.unwrap_or_default()));
        }
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let mut buf = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _)
            .result()
            .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let _ = nvrtc::destroy_program(prog);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel directory's files replace the embedded sources (and so change the cubin's cache
    /// key); a file missing there is an error that names it.
    #[test]
    fn kernel_dir_replaces_the_sources_and_names_a_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        for (n, s) in SOURCES {
            std::fs::write(dir.path().join(n), format!("// variant\n{s}")).unwrap();
        }
        let variant = kernel_sources(Some(dir.path())).unwrap();
        assert!(variant.iter().all(|(_, s)| s.starts_with("// variant\n")));
        let embedded = kernel_sources(None).unwrap();
        assert_ne!(source_hash(&variant, &[]), source_hash(&embedded, &[]));
        std::fs::remove_file(dir.path().join("moe.cu")).unwrap();
        let err = kernel_sources(Some(dir.path())).unwrap_err().to_string();
        assert!(
            err.contains("moe.cu") && err.contains("kernel_dir"),
            "{err}"
        );
    }

    #[test]
    fn the_options_follow_the_kv_type_and_the_timeline_feature() {
        let f16 = compile_options((9, 0), KvType::F16);
        assert!(f16.contains(&"-DKV_F16".to_string()));
        assert!(f16.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(!compile_options((9, 0), KvType::F32).contains(&"-DKV_F16".to_string()));
        let timeline = f16.iter().any(|o| o == "-DQ4MOE_TIMELINE");
        assert_eq!(timeline, cfg!(feature = "timeline"));
    }
}
