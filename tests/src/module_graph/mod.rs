//! The workspace's files and the `use` graph between them, read as text: which files of a crate
//! import each other in a loop, and which source files grew past the size a file may have
//! without saying why (`tests/tests/structure.rs` holds the workspace to both).
//!
//! A file imports another when it names a module defined there: in a `use` tree, or inline in
//! code (`crate::a::b::f()`, `super::x::T`, a child module's name followed by `::`). The path is
//! followed down the crate's module tree as far as it names modules, so `use crate::link::Plan`
//! imports `link/mod.rs` (where `Plan` is re-exported or defined), not the file behind it. Two
//! arrows are not imports: a parent's `mod child;` declaration, and a path from a module to one
//! of its own ancestors (`super::…`, or `crate::…` naming the root's items: a test module's
//! `use super::*`, a child using its parent's types): a module and its children are one unit
//! by design. Everything else is an arrow — between siblings, cousins, or from a parent down —
//! including the paths written in test modules, and a loop of arrows between files is reported
//! with the names that tie each pair.
//!
//! The reader is a small lexer, not a parser: comments, strings and character literals are
//! blanked first, then `mod` items, `use` trees and `::` paths are picked out of the tokens.
//! Macros' `$crate::` paths and `pub(in …)` restrictions are not imports. What it cannot see
//! (a path built by a macro, `#[path]` attributes, which the workspace does not use) it misses
//! rather than invents, so a loop it reports is a loop in the code.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use lexer::{blank, tokens};
use syntax::{mod_items, paths};

mod lexer;
mod syntax;

/// A set of files that import each other in a loop (a strongly connected component of the
/// import graph with more than one file), with the arrows between them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportLoop {
    /// The files, sorted.
    pub files: Vec<PathBuf>,
    /// Each arrow inside the loop: from, to, and the paths that make it.
    pub arrows: Vec<(PathBuf, PathBuf, Vec<String>)>,
}

impl std::fmt::Display for ImportLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{} files import each other in a loop:", self.files.len())?;
        for (from, to, names) in &self.arrows {
            writeln!(f, "  {} -> {}: {}", from.display(), to.display(), names.join(", "))?;
        }
        Ok(())
    }
}

/// The crates of the workspace at `root`: every member listed in its `Cargo.toml`.
pub fn workspace_members(root: &Path) -> io::Result<Vec<PathBuf>> {
    let manifest = fs::read_to_string(root.join("Cargo.toml"))?;
    let start = manifest.find("members").ok_or_else(|| invalid("no workspace members"))?;
    let list = &manifest[start..];
    let list = &list[list.find('[').ok_or_else(|| invalid("members is not a list"))? + 1
        ..list.find(']').ok_or_else(|| invalid("members is not a list"))?];
    Ok(list
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| root.join(m))
        .collect())
}

/// Every loop of imports inside the crate at `crate_dir` (each of its targets: library,
/// binaries, integration tests, benches, build script).
pub fn crate_loops(crate_dir: &Path) -> io::Result<Vec<ImportLoop>> {
    let mut loops = Vec::new();
    for root in target_roots(crate_dir)? {
        let tree = ModuleTree::read(&root)?;
        loops.extend(tree.loops()?);
    }
    Ok(loops)
}

/// The package name of the crate at `crate_dir` and the workspace crates (`ferry-*`) it lists
/// under `[dependencies]` (not dev- or build-dependencies), sorted.
pub fn crate_dependencies(crate_dir: &Path) -> io::Result<(String, Vec<String>)> {
    let manifest = fs::read_to_string(crate_dir.join("Cargo.toml"))?;
    let mut name = None;
    let mut deps = Vec::new();
    let mut section = String::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        let Some((key, value)) = line.split_once('=') else { continue };
        let key = key.trim();
        if section == "[package]" && key == "name" {
            name = Some(value.trim().trim_matches('"').to_string());
        } else if section == "[dependencies]" && key.starts_with("ferry-") {
            deps.push(key.trim_end_matches(".workspace").to_string());
        }
    }
    deps.sort();
    Ok((name.ok_or_else(|| invalid("no package name"))?, deps))
}

/// A source file of the crate at `crate_dir` that is longer than `limit` lines, not counting
/// an inline `#[cfg(test)] mod tests { … }` at its end, and whose head does not say why it
/// must be one file (a `//!` line starting `Why one file:`). Test modules and integration
/// tests are not counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LongFile {
    /// The file.
    pub path: PathBuf,
    /// Its lines outside the trailing test module.
    pub lines: usize,
    /// Whether its head says why it is one file.
    pub has_reason: bool,
}

/// The library and binary files of the crate at `crate_dir` over `limit` lines (see
/// [`LongFile`]).
pub fn long_files(crate_dir: &Path, limit: usize) -> io::Result<Vec<LongFile>> {
    let mut long = Vec::new();
    for root in target_roots(crate_dir)? {
        if !root.starts_with(crate_dir.join("src")) {
            continue;
        }
        let tree = ModuleTree::read(&root)?;
        for (path, module) in &tree.files {
            if module.iter().any(|m| m == "tests") {
                continue;
            }
            let text = fs::read_to_string(path)?;
            let lines = non_test_lines(&text);
            if lines > limit {
                let has_reason = text
                    .lines()
                    .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
                    .any(|l| l.trim_start_matches("//!").trim().starts_with("Why one file:"));
                long.push(LongFile { path: path.clone(), lines, has_reason });
            }
        }
    }
    long.sort_by(|a, b| a.path.cmp(&b.path));
    long.dedup();
    Ok(long)
}

/// The lines of `text` before a trailing top-level `#[cfg(test)]` test module.
fn non_test_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    for (i, pair) in lines.windows(2).enumerate() {
        if pair[0] == "#[cfg(test)]" && pair[1].starts_with("mod tests {") {
            return i;
        }
    }
    lines.len()
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// The root files of a crate's targets: each is its own module tree.
fn target_roots(crate_dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut roots = Vec::new();
    for file in ["src/lib.rs", "src/main.rs", "build.rs"] {
        let path = crate_dir.join(file);
        if path.is_file() {
            roots.push(path);
        }
    }
    for dir in ["src/bin", "tests", "benches", "examples"] {
        let Ok(entries) = fs::read_dir(crate_dir.join(dir)) else { continue };
        let mut found: Vec<PathBuf> = Vec::new();
        for entry in entries {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            } else if path.join("main.rs").is_file() {
                found.push(path.join("main.rs"));
            }
        }
        found.sort();
        roots.extend(found);
    }
    Ok(roots)
}

/// One target's modules: each module's path and the file that holds it.
struct ModuleTree {
    /// Module path → the file it is written in (an inline module is in its parent's file).
    modules: BTreeMap<Vec<String>, PathBuf>,
    /// File → the module path of the file itself.
    files: BTreeMap<PathBuf, Vec<String>>,
}

impl ModuleTree {
    fn read(root: &Path) -> io::Result<Self> {
        let mut tree = ModuleTree { modules: BTreeMap::new(), files: BTreeMap::new() };
        tree.add_file(root, &[], true)?;
        Ok(tree)
    }

    /// Adds `file` as module `path` and, recursively, the modules it declares.
    fn add_file(&mut self, file: &Path, path: &[String], is_dir_owner: bool) -> io::Result<()> {
        let text = fs::read_to_string(file)?;
        let tokens = tokens(&blank(&text));
        self.modules.insert(path.to_vec(), file.to_path_buf());
        self.files.insert(file.to_path_buf(), path.to_vec());
        // Children of `a.rs` live in `a/`; of `mod.rs`, `lib.rs`, `main.rs`, beside it.
        let parent = file.parent().unwrap_or(Path::new("."));
        let dir = if is_dir_owner {
            parent.to_path_buf()
        } else {
            parent.join(file.file_stem().unwrap_or_default())
        };
        for item in mod_items(&tokens) {
            let mut module = path.to_vec();
            module.extend(item.inline.iter().cloned());
            module.push(item.name.clone());
            if item.has_body {
                self.modules.insert(module, file.to_path_buf());
                continue;
            }
            let mut child_dir = dir.clone();
            for inline in &item.inline {
                child_dir.push(inline);
            }
            let flat = child_dir.join(format!("{}.rs", item.name));
            let nested = child_dir.join(&item.name).join("mod.rs");
            if flat.is_file() {
                self.add_file(&flat, &module, false)?;
            } else if nested.is_file() {
                self.add_file(&nested, &module, true)?;
            }
        }
        Ok(())
    }

    /// The arrows between files: (from, to) → the paths that make them.
    fn arrows(&self) -> io::Result<BTreeMap<(PathBuf, PathBuf), BTreeSet<String>>> {
        let mut arrows: BTreeMap<(PathBuf, PathBuf), BTreeSet<String>> = BTreeMap::new();
        for (file, module) in &self.files {
            let tokens = tokens(&blank(&fs::read_to_string(file)?));
            for (scope, path) in paths(&tokens) {
                let mut here = module.clone();
                here.extend(scope);
                let Some(target) = self.resolve(&here, &path) else { continue };
                let Some(to) = self.modules.get(&target) else { continue };
                if to == file || module.starts_with(&target) {
                    continue;
                }
                arrows.entry((file.clone(), to.clone())).or_default().insert(path.join("::"));
            }
        }
        Ok(arrows)
    }

    /// The deepest module that `path`, written in module `here`, names. `None` for a path that
    /// leaves the crate (another crate, a type's associated item).
    fn resolve(&self, here: &[String], path: &[String]) -> Option<Vec<String>> {
        let (mut module, rest) = match path.first()?.as_str() {
            "crate" => (Vec::new(), &path[1..]),
            "self" => (here.to_vec(), &path[1..]),
            "super" => {
                let supers = path.iter().take_while(|s| *s == "super").count();
                if supers > here.len() {
                    return None;
                }
                (here[..here.len() - supers].to_vec(), &path[supers..])
            }
            first => {
                let mut child = here.to_vec();
                child.push(first.to_string());
                if !self.modules.contains_key(&child) {
                    return None;
                }
                (here.to_vec(), path)
            }
        };
        for segment in rest {
            module.push(segment.clone());
            if !self.modules.contains_key(&module) {
                module.pop();
                break;
            }
        }
        Some(module)
    }

    fn loops(&self) -> io::Result<Vec<ImportLoop>> {
        let arrows = self.arrows()?;
        let files: Vec<&PathBuf> = self.files.keys().collect();
        let index: BTreeMap<&PathBuf, usize> =
            files.iter().enumerate().map(|(i, f)| (*f, i)).collect();
        let mut next = vec![Vec::new(); files.len()];
        for (from, to) in arrows.keys() {
            next[index[from]].push(index[to]);
        }
        Ok(strongly_connected(&next)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|component| {
                let mut in_loop: Vec<PathBuf> =
                    component.iter().map(|&i| files[i].clone()).collect();
                in_loop.sort();
                let arrows = arrows
                    .iter()
                    .filter(|((from, to), _)| in_loop.contains(from) && in_loop.contains(to))
                    .map(|((from, to), names)| {
                        (from.clone(), to.clone(), names.iter().cloned().collect())
                    })
                    .collect();
                ImportLoop { files: in_loop, arrows }
            })
            .collect())
    }
}

/// Tarjan's strongly connected components of the graph `next` (iterative).
fn strongly_connected(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
    const UNSEEN: usize = usize::MAX;
    let n = next.len();
    let (mut order, mut low, mut on_stack) = (vec![UNSEEN; n], vec![0; n], vec![false; n]);
    let (mut stack, mut components, mut counter) = (Vec::new(), Vec::new(), 0);
    for start in 0..n {
        if order[start] != UNSEEN {
            continue;
        }
        let mut work = vec![(start, 0)];
        while let Some(&mut (v, ref mut edge)) = work.last_mut() {
            if *edge == 0 {
                order[v] = counter;
                low[v] = counter;
                counter += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = next[v].get(*edge) {
                *edge += 1;
                if order[w] == UNSEEN {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(order[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == order[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                components.push(component);
            }
        }
    }
    components
}

#[cfg(test)]
mod tests {
    use super::syntax::use_tree;
    use super::*;

    #[test]
    fn literals_and_comments_are_blanked_but_lifetimes_and_lines_stay() {
        let text = "a /* crate::x */ b // super::y\n\"crate::z\" 'c' '\\n' r#\"q\"# &'a T";
        let out = blank(text);
        assert_eq!(out.lines().count(), 2);
        assert!(!out.contains("crate") && !out.contains("super"), "{out}");
        assert!(out.contains("&'a T"), "{out}");
    }

    #[test]
    fn use_trees_expand_groups_and_drop_renames() {
        let toks = tokens("crate::a::{b::C, d as e, self, f::{g, h::*}}");
        let paths: Vec<String> = use_tree(&toks, &[]).iter().map(|p| p.join("::")).collect();
        assert_eq!(
            paths,
            ["crate::a::b::C", "crate::a::d", "crate::a", "crate::a::f::g", "crate::a::f::h"]
        );
    }
}
