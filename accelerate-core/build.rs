//! With the `mpi` feature: compiles the MPI engine's C shim against the MPI library that
//! mpi-sys found (the same probe: `mpicc` when on the path, else pkg-config).

fn main() {
    #[cfg(feature = "mpi")]
    mpi_shim();
}

#[cfg(feature = "mpi")]
fn mpi_shim() {
    const SHIM: &str = "src/comm/transport/mpi/shim.c";
    println!("cargo:rerun-if-changed={SHIM}");
    let library = match build_probe_mpi::probe() {
        Ok(library) => library,
        Err(errors) => {
            for error in errors {
                eprintln!("{error}");
            }
            eprintln!(
                "the `mpi` feature needs an MPI library and its headers. hint: apt-get install \
                 libopenmpi-dev libclang-dev, or build without --features mpi"
            );
            std::process::exit(1);
        }
    };
    let mut build = cc::Build::new();
    build.file(SHIM);
    match library.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            for dir in &library.include_paths {
                build.include(dir);
            }
        }
    }
    build.compile("accelerate_mpi_shim");
}
