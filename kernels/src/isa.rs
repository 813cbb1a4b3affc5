//! Which instruction sets the CPU kernels may use: what this CPU has, capped by the
//! `ACCELERATE_CPU_ISA` variable so that a run (a test, a benchmark, a user chasing a
//! difference) can take the fallback paths on a CPU that has the fast ones.
//!
//! `ACCELERATE_CPU_ISA` = `amx` (or unset, `native`: no cap), `avx512bf16`, `avx512`, `avx2`
//! or `portable`. A value that names nothing is ignored with a warning on standard error. Read
//! once per process. It governs the bf16 products ([`crate::bf16_matmul`]); the f32 kernels
//! keep their own detection.

use std::sync::OnceLock;

/// Instruction sets, ordered: each includes what the ones below it offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, vectorised by the compiler for the build's target.
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512F on top.
    Avx512,
    /// AVX512_BF16 on top (`vdpbf16ps`).
    Avx512Bf16,
    /// AMX-TILE and AMX-BF16 on top (`tdpbf16ps`), the tile registers lent to this process.
    Amx,
}

impl Isa {
    /// The name `ACCELERATE_CPU_ISA` takes for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Avx512Bf16 => "avx512bf16",
            Self::Amx => "amx",
        }
    }

    /// The set a value of `ACCELERATE_CPU_ISA` names (`native` and the empty value: none).
    pub fn parse(value: &str) -> Option<Option<Self>> {
        Some(match value.trim().to_ascii_lowercase().as_str() {
            "" | "native" => None,
            "portable" | "scalar" => Some(Self::Portable),
            "avx2" => Some(Self::Avx2),
            "avx512" => Some(Self::Avx512),
            "avx512bf16" | "avx512_bf16" => Some(Self::Avx512Bf16),
            "amx" | "amx-bf16" | "amx_bf16" => Some(Self::Amx),
            _ => return None,
        })
    }
}

/// What this CPU has (checked once).
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2 && is_x86_feature_detected!("avx512f");
    let bf16 = avx512 && is_x86_feature_detected!("avx512bf16");
    if bf16 && amx_tiles_lent() {
        Isa::Amx
    } else if bf16 {
        Isa::Avx512Bf16
    } else if avx512 {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}

/// True when CPUID reports AMX-TILE and AMX-BF16 and Linux lends this process the tiles'
/// register state: it does so only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`, once per process, for all its threads); a tile instruction without it
/// ends the process with SIGILL.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
fn amx_tiles_lent() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    // Leaf 7, subleaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    let edx = __cpuid_count(7, 0).edx;
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: this request reads its two integer arguments and changes nothing but the
        // register state the kernel saves for this process; it touches no memory of ours.
        let granted = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        granted == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Portable
}

/// True when this CPU's `vdpbf16ps` issues at an f32 FMA's rate (32 multiply-adds where the
/// FMA does 16): AMD's AVX512_BF16 CPUs (Zen 4 and later). Intel's Sapphire and Emerald
/// Rapids issue it at half the rate of their two FMA ports (measured here: RESULTS, issue 60),
/// so f32 FMAs on widened operands are faster there; a Zen 4 issues it at the FMA's rate
/// (measured: 72.8 against 37.5 G multiply-adds/s on one core, RESULTS, issue 60 part six).
/// Checked once: `CPUID` leaves the VM on every call, and every product asks.
pub fn dot_products_at_fma_rate() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let vendor = std::arch::x86_64::__cpuid(0);
            let name: Vec<u8> = [vendor.ebx, vendor.edx, vendor.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            name == b"AuthenticAMD"
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// What the kernels use: [`detected`], capped by `ACCELERATE_CPU_ISA` (read once).
pub fn current() -> Isa {
    static CURRENT: OnceLock<Isa> = OnceLock::new();
    *CURRENT.get_or_init(|| {
        let cap = match std::env::var("ACCELERATE_CPU_ISA") {
            Ok(value) => Isa::parse(&value).unwrap_or_else(|| {
                eprintln!(
                    "accelerate-rs: ACCELERATE_CPU_ISA={value:?} names no instruction set \
                     (portable, avx2, avx512, avx512bf16 or native); ignored"
                );
                None
            }),
            Err(_) => None,
        };
        cap.map_or(detected(), |cap| cap.min(detected()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_ones_are_refused() {
        for isa in [
            Isa::Portable,
            Isa::Avx2,
            Isa::Avx512,
            Isa::Avx512Bf16,
            Isa::Amx,
        ] {
            assert_eq!(Isa::parse(isa.name()), Some(Some(isa)));
        }
        assert_eq!(Isa::parse("native"), Some(None));
        assert_eq!(Isa::parse(" AVX2 "), Some(Some(Isa::Avx2)));
        assert_eq!(Isa::parse("sse9"), None);
        assert!(current() <= detected());
    }
}
