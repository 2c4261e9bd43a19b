//! The source tree keeps its shape: layers without import cycles, and
//! files a reader can take in.

use std::path::Path;

#[test]
fn no_module_imports_in_a_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(root.join("scripts/layers"))
        .arg("--quiet")
        .output()
        .expect("running scripts/layers (needs python3)");
    assert!(out.status.success(), "scripts/layers found a cycle:\n{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn no_source_file_of_the_host_is_over_600_lines() {
    fn walk(dir: &Path, long: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).expect("reading host/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, long);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let lines = std::fs::read_to_string(&path).expect("reading a source file").lines().count();
                if lines > 600 {
                    long.push(format!("{} ({lines} lines)", path.display()));
                }
            }
        }
    }
    let mut long = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("host"), &mut long);
    assert!(long.is_empty(), "split these by what their parts own: {long:?}");
}
