//! Reading the Markdown of README.md and docs/ for `tests/tests/docs.rs`: fenced blocks (with
//! the `<!-- run by: ... -->` comment before them), the prose around them, tables, headings
//! and their anchors, and a console block's `$ command`s with the output they show.
use std::collections::BTreeSet;

/// A fenced code block: its info string, the 1-based line of its opening fence, its lines, and
/// the files a `<!-- run by: A, B -->` comment on the line before the fence (or the one before
/// a blank line) names.
pub struct Block {
    pub lang: String,
    pub line: usize,
    pub body: Vec<String>,
    pub run_by: Option<Vec<String>>,
}

pub fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].trim_start().strip_prefix("```") else {
            i += 1;
            continue;
        };
        let start = i;
        let mut body = Vec::new();
        i += 1;
        while i < lines.len() && !lines[i].trim_start().starts_with("```") {
            body.push(lines[i].to_string());
            i += 1;
        }
        let before = lines[..start]
            .iter()
            .rev()
            .take(2)
            .find(|l| !l.trim().is_empty());
        let run_by = before
            .and_then(|l| l.trim().strip_prefix("<!-- run by:"))
            .and_then(|r| r.strip_suffix("-->"))
            .map(|r| r.split(',').map(|f| f.trim().to_string()).collect());
        let lang = info.trim().to_string();
        out.push(Block {
            lang,
            line: start + 1,
            body,
            run_by,
        });
        i += 1;
    }
    out
}

/// The lines outside fenced blocks, with their 1-based numbers.
pub fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The cells of a table row, split at `|` but not at `\|`.
pub fn cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.next_if_eq(&'|').is_some() => cells.last_mut().unwrap().push('|'),
            '|' => cells.push(String::new()),
            c => cells.last_mut().unwrap().push(c),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The text of the first `code span` in `cell`.
pub fn first_code(cell: &str) -> Option<&str> {
    cell.split('`')
        .nth(1)
        .filter(|_| cell.matches('`').count() >= 2)
}

/// The body rows (not the header, not the `|---|` rule) of the tables in `lines`.
pub fn table_rows(lines: &[(usize, &str)]) -> Vec<(usize, Vec<String>)> {
    let mut rows = Vec::new();
    let mut previous_was_row = false;
    for &(n, line) in lines {
        let is_row = line.trim_start().starts_with('|');
        let rule = line.chars().all(|c| "|-: ".contains(c));
        if is_row && previous_was_row && !rule {
            rows.push((n, cells(line)));
        }
        previous_was_row = is_row;
    }
    rows
}

/// The prose lines of `text` under the heading `heading` (exactly), up to the next heading.
pub fn section<'t>(text: &'t str, heading: &str) -> Option<Vec<(usize, &'t str)>> {
    let lines = prose(text);
    let start = lines.iter().position(|(_, l)| l.trim_end() == heading)? + 1;
    let rest = &lines[start..];
    let end = rest.iter().position(|(_, l)| l.starts_with('#'));
    Some(rest[..end.unwrap_or(rest.len())].to_vec())
}

/// One `$ command` of a console block (continued over lines ending in `\`) and what it prints.
pub struct Step {
    pub line: usize,
    pub command: String,
    pub expected: Vec<String>,
}

pub fn steps(block: &Block) -> Result<Vec<Step>, String> {
    let mut steps: Vec<Step> = Vec::new();
    let mut lines = block.body.iter().enumerate();
    while let Some((i, line)) = lines.next() {
        let line_no = block.line + 1 + i;
        if let Some(command) = line.strip_prefix("$ ") {
            let mut command = command.to_string();
            while command.ends_with('\\') {
                let Some((_, next)) = lines.next() else { break };
                command = format!("{command}\n{next}");
            }
            steps.push(Step {
                line: line_no,
                command,
                expected: Vec::new(),
            });
        } else if let Some(step) = steps.last_mut() {
            step.expected.push(line.trim_end().to_string());
        } else {
            return Err(format!("line {line_no}: output before any `$ command`"));
        }
    }
    if steps.is_empty() {
        return Err("a console block without a `$ command`".into());
    }
    Ok(steps)
}

/// Whether `actual` is `expected`, where `[..]` matches any text.
pub fn line_matches(expected: &str, actual: &str) -> bool {
    let parts: Vec<&str> = expected.split("[..]").collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 || actual.len() < first.len() + last.len() {
        return expected == actual;
    }
    if !actual.starts_with(first) || !actual.ends_with(last) {
        return false;
    }
    let mut rest = &actual[first.len()..actual.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        let Some(at) = rest.find(part) else {
            return false;
        };
        rest = &rest[at + part.len()..];
    }
    true
}

/// Whether the lines `actual` are `expected`, where a line `...` matches any lines.
pub fn lines_match(expected: &[String], actual: &[&str]) -> bool {
    // fits[i][j]: expected[i..] matches actual[j..]
    let (n, m) = (expected.len(), actual.len());
    let mut fits = vec![vec![false; m + 1]; n + 1];
    fits[n][m] = true;
    for i in (0..n).rev() {
        for j in (0..=m).rev() {
            fits[i][j] = if expected[i].trim() == "..." {
                fits[i + 1][j] || (j < m && fits[i][j + 1])
            } else {
                j < m && line_matches(&expected[i], actual[j]) && fits[i + 1][j + 1]
            };
        }
    }
    fits[0][0]
}

/// `text` with every `\` line continuation joined into one line.
pub fn joined(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let mut line = line.to_string();
        while line.ends_with('\\') {
            line.pop();
            let Some(next) = lines.next() else { break };
            line = format!("{} {}", line.trim_end(), next.trim_start());
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// GitHub's anchor for a heading: lower case, letters, digits, `-`, `_` and spaces as `-`.
pub fn slug(heading: &str) -> String {
    let text = heading.trim_start_matches('#').trim().to_lowercase();
    let kept = text
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '));
    kept.map(|c| if c == ' ' { '-' } else { c }).collect()
}

/// The anchors of `text`'s headings (a repeated one gets `-1`, `-2`, ... as GitHub does).
pub fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in prose(text).into_iter().filter(|(_, l)| l.starts_with('#')) {
        let base = slug(line);
        let mut anchor = base.clone();
        for n in 1.. {
            if seen.insert(anchor.clone()) {
                break;
            }
            anchor = format!("{base}-{n}");
        }
    }
    seen
}
