//! The module graph's reading of the tokens: the `mod` items a file declares (and the inline
//! modules around them), and every module path it names — each path of each `use` tree, groups
//! expanded, and each `a::b…` path elsewhere in code — with the inline module it is written in.

/// A `mod` item: its name, the inline modules it is declared in, and whether it has a body.
pub(super) struct ModItem {
    pub(super) name: String,
    pub(super) inline: Vec<String>,
    pub(super) has_body: bool,
}

pub(super) fn mod_items(tokens: &[String]) -> Vec<ModItem> {
    let mut items = Vec::new();
    walk(tokens, |i, scope| {
        if tokens[i] == "mod" && is_ident(tokens.get(i + 1)) {
            let has_body = tokens.get(i + 2).is_some_and(|t| t == "{");
            if has_body || tokens.get(i + 2).is_some_and(|t| t == ";") {
                let name = tokens[i + 1].clone();
                items.push(ModItem { name, inline: scope.to_vec(), has_body });
            }
        }
    });
    items
}

/// Calls `visit(i, inline_scope)` for each token, with the inline modules it is inside.
fn walk(tokens: &[String], mut visit: impl FnMut(usize, &[String])) {
    let mut scope: Vec<String> = Vec::new();
    // Brace depth, and the depth at which each open inline module's body started.
    let (mut depth, mut opened) = (0usize, Vec::new());
    for i in 0..tokens.len() {
        visit(i, &scope);
        match tokens[i].as_str() {
            "{" => {
                depth += 1;
                if i >= 2 && tokens[i - 2] == "mod" && is_ident(tokens.get(i - 1)) {
                    scope.push(tokens[i - 1].clone());
                    opened.push(depth);
                }
            }
            "}" => {
                if opened.last() == Some(&depth) {
                    opened.pop();
                    scope.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
    }
}

fn is_ident(token: Option<&String>) -> bool {
    token.is_some_and(|t| t.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_'))
}

/// Every module path in the tokens, with the inline module scope it is written in: each path
/// of each `use` tree (groups expanded), and each `a::b…` path elsewhere.
pub(super) fn paths(tokens: &[String]) -> Vec<(Vec<String>, Vec<String>)> {
    let mut found = Vec::new();
    let mut use_end = 0;
    walk(tokens, |i, scope| {
        if i < use_end {
            return;
        }
        if tokens[i] == "use" {
            let end = tokens[i..].iter().position(|t| t == ";").map_or(tokens.len(), |p| i + p);
            for path in use_tree(&tokens[i + 1..end], &[]) {
                found.push((scope.to_vec(), path));
            }
            use_end = end;
            return;
        }
        let starts_path = is_ident(tokens.get(i))
            && tokens.get(i + 1).is_some_and(|t| t == "::")
            && !(i > 0 && (tokens[i - 1] == "::" || tokens[i - 1] == "$"))
            && !(i > 1 && tokens[i - 1] == "in" && tokens[i - 2] == "(");
        if starts_path {
            let mut path = vec![tokens[i].clone()];
            let mut j = i + 1;
            while tokens.get(j).is_some_and(|t| t == "::") && is_ident(tokens.get(j + 1)) {
                path.push(tokens[j + 1].clone());
                j += 2;
            }
            found.push((scope.to_vec(), path));
        }
    });
    found
}

/// The paths of a `use` tree (the tokens between `use` and `;`), each under `prefix`.
pub(super) fn use_tree(tokens: &[String], prefix: &[String]) -> Vec<Vec<String>> {
    let mut path = prefix.to_vec();
    let mut i = 0;
    while i < tokens.len() {
        match tokens[i].as_str() {
            "::" => i += 1,
            "{" => {
                // Split the group at its top-level commas.
                let mut out = Vec::new();
                let (mut depth, mut start) = (0, i + 1);
                for j in i + 1..tokens.len() {
                    match tokens[j].as_str() {
                        "{" => depth += 1,
                        "}" if depth == 0 => {
                            out.extend(use_tree(&tokens[start..j], &path));
                            return out;
                        }
                        "}" => depth -= 1,
                        "," if depth == 0 => {
                            out.extend(use_tree(&tokens[start..j], &path));
                            start = j + 1;
                        }
                        _ => {}
                    }
                }
                return out;
            }
            "as" | "*" => break,
            "self" if !path.is_empty() => i += 1,
            t if is_ident(Some(&tokens[i])) => {
                path.push(t.to_string());
                i += 1;
            }
            _ => i += 1,
        }
    }
    if path.is_empty() {
        Vec::new()
    } else {
        vec![path]
    }
}
