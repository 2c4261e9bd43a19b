//! `leasehold new NAME --lang LANG [--dir DIR]`: writes a plugin project
//! that builds with one command and tests itself with `leasehold run`: the
//! `leasehold:turn` WIT, a build script, a turn that uses `http`, `kv` and
//! `emit` through typed helpers, a test and a README. The templates are in
//! `templates/`, embedded in the binary.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
    C,
}

#[derive(clap::Args)]
pub struct NewArgs {
    /// The plugin's name (1 to 64 of a-z, 0-9, '-', '_'), and the directory's.
    name: String,
    /// The guest language.
    #[arg(long)]
    lang: Lang,
    /// Where to write the project. Default: ./NAME. It must not exist, or
    /// be empty.
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// A template file: its path in the project, its text, and whether it is
/// a script.
type File = (&'static str, &'static str, bool);

const COMMON: &[File] = &[
    ("wit/turn.wit", include_str!("../../wit/turn.wit"), false),
    ("test.sh", include_str!("../../templates/common/test.sh"), true),
    ("README.md", include_str!("../../templates/common/README.md"), false),
];

const RUST: &[File] = &[
    ("Cargo.toml", include_str!("../../templates/rust/Cargo.toml"), false),
    ("build.sh", include_str!("../../templates/rust/build.sh"), true),
    ("src/lib.rs", include_str!("../../templates/rust/src/lib.rs"), false),
    ("src/helpers.rs", include_str!("../../templates/rust/src/helpers.rs"), false),
    (".gitignore", "target/\n*.wasm\n", false),
];

const PYTHON: &[File] = &[
    ("build.sh", include_str!("../../templates/python/build.sh"), true),
    ("app.py", include_str!("../../templates/python/app.py"), false),
    ("helpers.py", include_str!("../../templates/python/helpers.py"), false),
    (".gitignore", "target/\n*.wasm\n.venv/\n__pycache__/\n", false),
];

const JS: &[File] = &[
    ("build.sh", include_str!("../../templates/js/build.sh"), true),
    ("app.js", include_str!("../../templates/js/app.js"), false),
    ("helpers.js", include_str!("../../templates/js/helpers.js"), false),
    ("package.json", include_str!("../../templates/js/package.json"), false),
    (".gitignore", "target/\n*.wasm\nnode_modules/\n", false),
];

const C: &[File] = &[
    ("build.sh", include_str!("../../templates/c/build.sh"), true),
    ("turn.c", include_str!("../../templates/c/turn.c"), false),
    ("leasehold.h", include_str!("../../templates/c/leasehold.h"), false),
    (".gitignore", "target/\n*.wasm\n", false),
];

/// Each language's files, its name in prose, and what its build needs.
fn language(lang: Lang) -> (&'static [File], &'static str, &'static str) {
    match lang {
        Lang::Rust => (RUST, "Rust", "cargo and the wasm32-wasip2 target; `build.sh` adds the target with rustup"),
        Lang::Python => (PYTHON, "Python", "componentize-py 0.25.1; see the top of `build.sh`"),
        Lang::Js => (JS, "JavaScript", "Node.js 18 or later; `build.sh` runs `npm install` for componentize-js 0.23.0"),
        Lang::C => (C, "C", "clang-16, lld-16, wasi-libc, wit-bindgen 0.57.1 and wasm-tools; see the top of `build.sh`"),
    }
}

pub fn new(args: NewArgs) -> Result<()> {
    if !leasehold::plugins::valid_name(&args.name) {
        bail!("{:?} is not a plugin name: use 1 to 64 of a-z, 0-9, '-' and '_'", args.name);
    }
    let dir = args.dir.clone().unwrap_or_else(|| PathBuf::from(&args.name));
    if dir.exists() && std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?.next().is_some() {
        bail!("{} already exists and is not empty", dir.display());
    }
    let (files, lang, toolchain) = language(args.lang);
    let listed: Vec<&str> = COMMON.iter().chain(files).map(|(p, _, _)| *p).filter(|p| !p.starts_with('.')).collect();
    let fill = |text: &str| {
        text.replace("{{name}}", &args.name)
            .replace("{{crate}}", &args.name.replace('-', "_"))
            .replace("{{lang}}", lang)
            .replace("{{toolchain}}", toolchain)
            .replace("{{files}}", &listed.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", "))
    };
    for (path, text, script) in COMMON.iter().chain(files) {
        write(&dir.join(path), &fill(text), *script)?;
    }
    println!("created {} ({lang}): cd {} && ./test.sh", dir.display(), dir.display());
    Ok(())
}

fn write(path: &Path, text: &str, script: bool) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    if script {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}
