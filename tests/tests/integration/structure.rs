//! The workspace's structure, held by tests: no files that import each other in a loop, no
//! source file past 600 lines without its head saying why it must be one file, and the crate
//! graph drawn in `docs/ARCHITECTURE.md` equal to the one the manifests declare. The checker
//! (`ferry_tests::module_graph`) is tested here too, on a fixture with a planted loop.

use std::path::{Path, PathBuf};

use ferry_tests::module_graph::{
    crate_dependencies, crate_loops, long_files, workspace_members, ImportLoop,
};

/// Past this many lines (its trailing test module not counted) a file's head says why it is
/// one file (`//! Why one file: …`).
const LONG_FILE: usize = 600;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn no_two_files_of_a_crate_import_each_other_in_a_loop() {
    let members = workspace_members(&workspace()).unwrap();
    assert!(members.len() >= 10, "workspace members: {members:?}");
    let mut loops = Vec::new();
    for member in &members {
        loops.extend(crate_loops(member).unwrap());
    }
    let report: String = loops.iter().map(ImportLoop::to_string).collect();
    assert!(loops.is_empty(), "{report}");
}

#[test]
fn the_checker_reports_a_loop_planted_through_use_super_and_an_inline_crate_path() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/import-loop");
    let loops = crate_loops(&fixture).unwrap();
    let src = fixture.join("src");
    assert_eq!(loops.len(), 1, "{loops:?}");
    let found = &loops[0];
    let files = ["a.rs", "b.rs", "c/d.rs"].map(|f| src.join(f));
    assert_eq!(found.files, files, "{found}");
    let arrow =
        |from: &str, to: &str, name: &str| (src.join(from), src.join(to), vec![name.to_string()]);
    assert_eq!(
        found.arrows,
        [
            arrow("a.rs", "b.rs", "crate::b::helper"),
            arrow("b.rs", "c/d.rs", "crate::c::d::g"),
            arrow("c/d.rs", "a.rs", "super::super::a::A"),
        ],
        "{found}"
    );
}

#[test]
fn no_source_file_is_over_600_lines_without_saying_why() {
    let mut unexplained = Vec::new();
    let mut explained = 0;
    for member in workspace_members(&workspace()).unwrap() {
        for long in long_files(&member, LONG_FILE).unwrap() {
            if long.has_reason {
                explained += 1;
            } else {
                unexplained.push(format!("{} ({} lines)", long.path.display(), long.lines));
            }
        }
    }
    eprintln!("files over {LONG_FILE} lines, each saying why: {explained}");
    assert!(
        unexplained.is_empty(),
        "over {LONG_FILE} lines with no reason in the head: {unexplained:#?}"
    );
}

#[test]
fn the_crate_graph_in_the_architecture_doc_is_the_manifests_graph() {
    let root = workspace();
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let start = doc.find("```crate-graph\n").expect("a ```crate-graph block in ARCHITECTURE.md");
    let block = &doc[start + "```crate-graph\n".len()..];
    let block = &block[..block.find("```").expect("the block ends")];
    let mut drawn: Vec<(String, Vec<String>)> = block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (name, deps) = l.split_once("->").unwrap_or((l, ""));
            let mut deps: Vec<String> =
                deps.split(',').map(|d| d.trim().to_string()).filter(|d| !d.is_empty()).collect();
            deps.sort();
            (name.trim().to_string(), deps)
        })
        .collect();
    drawn.sort();
    let mut declared: Vec<(String, Vec<String>)> =
        workspace_members(&root).unwrap().iter().map(|m| crate_dependencies(m).unwrap()).collect();
    declared.sort();
    assert!(declared.len() >= 14, "{declared:?}");
    assert_eq!(drawn, declared, "docs/ARCHITECTURE.md's crate graph (left) is not the manifests'");
}
