//! `accelerate-rs env` says which CPU kernels this machine takes, and `ACCELERATE_CPU_ISA`
//! caps them (what a user forcing the fallback path sees).

use std::process::Command;

use accelerate_kernels::bf16_matmul::Bf16Path;
use accelerate_kernels::isa::{self, Isa};

fn cpu_line(cap: Option<&str>) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"));
    command.arg("env").env_remove("ACCELERATE_CPU_ISA");
    if let Some(cap) = cap {
        command.env("ACCELERATE_CPU_ISA", cap);
    }
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}");
    stdout
        .lines()
        .find(|l| l.starts_with("CPU kernels: "))
        .unwrap_or_else(|| panic!("no CPU line: {stdout}"))
        .to_string()
}

#[test]
fn env_names_the_cpu_kernels_and_a_cap_takes_the_fallback_path() {
    let detected = isa::detected();
    let line = cpu_line(None);
    assert!(
        line.starts_with(&format!("CPU kernels: {};", detected.name())),
        "{line}"
    );
    let expected = match Bf16Path::detect() {
        Bf16Path::Amx => "AMX tiles",
        Bf16Path::Avx512Bf16 => "vdpbf16ps",
        Bf16Path::Avx512 => "AVX-512 FMAs",
        Bf16Path::Avx2 => "AVX2 FMAs",
        Bf16Path::Widened => "widened to f32",
    };
    assert!(line.contains(expected), "{line}");
    if detected == Isa::Amx {
        // Capped below the tiles: AVX512_BF16's own path on AMD, FMAs on Intel.
        let capped = cpu_line(Some("avx512bf16"));
        assert!(
            capped.contains("capped to avx512bf16 by ACCELERATE_CPU_ISA")
                && !capped.contains("AMX tiles"),
            "{capped}"
        );
    }
    if detected > Isa::Avx2 {
        let capped = cpu_line(Some("avx2"));
        assert!(
            capped.contains("capped to avx2 by ACCELERATE_CPU_ISA")
                && capped.contains("bf16 products: AVX2 FMAs"),
            "{capped}"
        );
    }
    if detected > Isa::Portable {
        let capped = cpu_line(Some("portable"));
        assert!(
            capped.contains("capped to portable by ACCELERATE_CPU_ISA")
                && capped.contains("bf16 products: widened to f32"),
            "{capped}"
        );
    }
}
