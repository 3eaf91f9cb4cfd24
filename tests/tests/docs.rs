//! The documentation cannot drift from the code. This file owns every check of README.md and
//! docs/*.md against what the built binaries and the config schema say:
//! - docs/reference.md documents every long flag of each binary's `--help` and no other, with
//!   the `[default: X]` that `--help` shows, and every config key of the schema (asked of the
//!   parser itself) and no other, with the default `Config::default()` has (`unset` for none);
//! - every ```console block is run: each `$ command` (with `bash -c`, `target/release` first on
//!   PATH, in a scratch directory holding `configs/` and an empty cache, so nothing is left in
//!   the repository; a document's blocks in order, in one scratch directory of its own) must
//!   print what the block shows below it, where a line `...`
//!   stands for any lines and `[..]` for any text within a line;
//! - every ```sh / ```bash block is preceded by `<!-- run by: FILE[, FILE] -->` naming files
//!   (a test, or a script CI runs) that exist and hold each of its command lines verbatim;
//! - every table in docs/figures.md names, in the paragraph just before it, the script that
//!   produced it and the date it was measured;
//! - every relative link, to a file or to a `#heading`, resolves.

mod markdown;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::config::Config;
use markdown::*;
use support::{bin, bin_dir, repo_root, wait_output};

// ---------------------------------------------------------------------------------------------
// The documents.

/// README.md, then every Markdown file in docs/.
fn doc_files() -> Vec<PathBuf> {
    let root = repo_root();
    let entries = std::fs::read_dir(root.join("docs")).expect("docs/");
    let mut docs: Vec<PathBuf> = entries.map(|e| e.expect("docs/ entry").path()).collect();
    docs.retain(|p| p.extension().is_some_and(|x| x == "md"));
    docs.sort();
    docs.insert(0, root.join("README.md"));
    docs
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `path` relative to the repository root, for messages.
fn rel(path: &Path) -> String {
    let root = repo_root();
    path.strip_prefix(&root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Panics with every error, one a line, unless there are none.
fn assert_none(errors: Vec<String>) {
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// (a) Every flag of every binary, with its default.

/// The binaries whose flags docs/reference.md documents, each under `### `NAME``.
const BINARIES: [&str; 8] = [
    "launch",
    "worker",
    "fetch",
    "recommend",
    "gen-data",
    "plot-curves",
    "gpt2-encode",
    "export-split",
];

/// The long flags of `NAME --help` (aliases included), each with the `[default: X]` shown.
fn help_flags(name: &str) -> BTreeMap<String, Option<String>> {
    let out = Command::new(bin(name))
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(out.status.success(), "{name} --help failed");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let bracket = |line: &str, tag: &str| {
        let rest = line.split(tag).nth(1)?;
        Some(rest.split(']').next()?.to_string())
    };
    let mut flags = BTreeMap::new();
    // clap puts a flag's help, with its `[default: X]` and `[alias: ...]`, on the flag's line
    // or, when some flags are long, on the lines under it: read each flag's lines together.
    let mut entries: Vec<String> = Vec::new();
    for line in text.lines().map(str::trim_start) {
        match entries.last_mut() {
            _ if line.starts_with('-') => entries.push(line.to_string()),
            Some(entry) if !line.is_empty() => {
                entry.push(' ');
                entry.push_str(line);
            }
            _ => {}
        }
    }
    for line in &entries {
        let default = bracket(line, "[default: ");
        let mut words = line
            .split_whitespace()
            .take(2)
            .map(|w| w.trim_end_matches(','));
        if let Some(flag) = words.find(|w| w.starts_with("--")) {
            flags.insert(flag.to_string(), default.clone());
        }
        let aliases = bracket(line, "[alias: ").or_else(|| bracket(line, "[aliases: "));
        for alias in aliases.iter().flat_map(|a| a.split(", ")) {
            flags.insert(alias.to_string(), default.clone());
        }
    }
    assert!(flags.contains_key("--help"), "no flags read from:\n{text}");
    flags
}

/// Every `--flag` in `cell`.
fn flags_in(cell: &str) -> Vec<String> {
    let name_char = |c: &char| c.is_ascii_alphanumeric() || *c == '-' || *c == '_';
    let names = cell
        .match_indices("--")
        .map(|(i, _)| cell[i + 2..].chars().take_while(name_char));
    names
        .map(|n| format!("--{}", n.collect::<String>()))
        .filter(|f| f.len() > 2)
        .collect()
}

/// Why the rows under `### `name`` do not document `name --help`'s flags and defaults.
fn flag_errors(text: &str, name: &str) -> Vec<String> {
    let help = help_flags(name);
    let Some(lines) = section(text, &format!("### `{name}`")) else {
        return vec![format!("docs/reference.md: no heading \"### `{name}`\"")];
    };
    let rows = table_rows(&lines);
    let documented: BTreeSet<String> = rows.iter().flat_map(|(_, c)| flags_in(&c[0])).collect();
    let mut errors: Vec<String> = (help.keys().filter(|f| !documented.contains(*f)))
        .map(|f| format!("docs/reference.md: `{name} {f}` (in its --help) is not documented"))
        .collect();
    for (line, row) in &rows {
        let default = row.get(1).and_then(|c| first_code(c));
        for flag in flags_in(&row[0]) {
            let at = format!("docs/reference.md:{line}: `{name} {flag}`");
            match help.get(&flag) {
                None => errors.push(format!("{at} is documented, but not in its --help")),
                Some(Some(d)) if default != Some(d) => errors.push(format!(
                    "{at}: --help says [default: {d}], here {default:?}"
                )),
                Some(_) => {}
            }
        }
    }
    errors
}

#[test]
fn reference_documents_every_flag_of_every_binary_with_its_default() {
    let text = read(&repo_root().join("docs/reference.md"));
    assert_none(
        BINARIES
            .iter()
            .flat_map(|name| flag_errors(&text, name))
            .collect(),
    );
}

// ---------------------------------------------------------------------------------------------
// (b) Every config key, with its default.

/// Every key (`section.key`) the config parser accepts, from its own "expected one of" list.
fn schema_keys() -> Vec<String> {
    let expected = |text: &str| -> Vec<String> {
        let error = Config::parse(text, "probe.toml", &[])
            .expect_err("an unknown key")
            .to_string();
        let list = error
            .split("expected one of: ")
            .nth(1)
            .and_then(|r| r.split(')').next());
        let list = list.unwrap_or_else(|| panic!("no key list in: {error}"));
        list.split(", ").map(String::from).collect()
    };
    let mut keys = Vec::new();
    for section in expected("not_a_key = 1\n") {
        for key in expected(&format!("[{section}]\nnot_a_key = 1\n")) {
            keys.push(format!("{section}.{key}"));
        }
    }
    keys
}

/// The keys whose default is unset (`None` in `Config::default()`'s fields).
fn unset_keys() -> BTreeSet<String> {
    let debug = format!("{:#?}", Config::default());
    let mut section = "";
    let mut unset = BTreeSet::new();
    for line in debug.lines() {
        let depth = line.len() - line.trim_start().len();
        let Some((name, value)) = line.trim_start().split_once(": ") else {
            continue;
        };
        match depth {
            4 => section = name,
            8 if value.trim_end_matches(',') == "None" => {
                unset.insert(format!("{section}.{name}"));
            }
            _ => {}
        }
    }
    unset
}

/// `docs/reference.md`'s config table: key -> (line, default cell).
fn documented_keys(text: &str) -> BTreeMap<String, (usize, String)> {
    let lines = section(text, "## Config keys").expect("docs/reference.md: ## Config keys");
    let mut keys = BTreeMap::new();
    for (line, row) in table_rows(&lines) {
        let key = first_code(&row[0]).unwrap_or_else(|| panic!("docs/reference.md:{line}: key?"));
        let cell = row.get(1).cloned().unwrap_or_default();
        let again = keys.insert(key.to_string(), (line, cell));
        assert!(again.is_none(), "docs/reference.md:{line}: `{key}` twice");
    }
    keys
}

/// Why `cell` (the reference's default column) is not the schema's default of `key`.
fn default_mismatch(key: &str, cell: &str, written: &toml::Table) -> Option<String> {
    if unset_keys().contains(key) {
        return (!cell.starts_with("unset")).then(|| format!("unset in the schema, here {cell:?}"));
    }
    let Some(value) = first_code(cell) else {
        return Some(format!(
            "set in the schema, here {cell:?} (want `VALUE`, then notes)"
        ));
    };
    let (section, name) = key.split_once('.').expect("section.key");
    if let Some(actual) = written.get(section).and_then(|s| s.get(name)) {
        let parsed: Option<toml::Table> = toml::from_str(&format!("v = {value}")).ok();
        let parsed = parsed.and_then(|t| t.get("v").cloned());
        return (parsed.as_ref() != Some(actual))
            .then(|| format!("{actual} in the schema, here {value}"));
    }
    // Not written when it is the default (a zero, a false): setting it to the documented value
    // must then change nothing.
    let base = "[batch]\nglobal = 8\n";
    let plain = Config::parse(base, "base", &[]).expect("base config");
    let set = Config::parse(base, "base", &[format!("{key}={value}")]);
    (set.as_ref().ok() != Some(&plain)).then(|| format!("--set {key}={value} is not the default"))
}

#[test]
fn reference_documents_every_config_key_with_its_default() {
    let documented = documented_keys(&read(&repo_root().join("docs/reference.md")));
    let keys = schema_keys();
    assert!(keys.len() > 40, "{keys:?}");
    let written = Config::default().to_toml().expect("to_toml");
    let written: toml::Table = toml::from_str(&written).expect("TOML");
    let mut errors = Vec::new();
    for key in &keys {
        match documented.get(key) {
            None => errors.push(format!(
                "docs/reference.md: config key `{key}` is not documented"
            )),
            Some((line, cell)) => errors.extend(
                default_mismatch(key, cell, &written)
                    .map(|why| format!("docs/reference.md:{line}: `{key}`: default {why}")),
            ),
        }
    }
    for (key, (line, _)) in documented.iter().filter(|(k, _)| !keys.contains(k)) {
        errors.push(format!(
            "docs/reference.md:{line}: `{key}` is not a key of the config schema"
        ));
    }
    assert_none(errors);
}

// ---------------------------------------------------------------------------------------------
// (c) Every command is run: console blocks here, the others where `run by` says.

/// What `command` prints (stdout and stderr together) run with `bash -c` in `scratch` as a
/// newcomer would: the built binaries first on PATH, an empty cache, and none of the job shape
/// or test hooks of the environment the tests run in.
fn run_step(command: &str, scratch: &Path) -> String {
    let mut cmd = Command::new("bash");
    let prefixes = ["SLURM_", "PET_", "GPTREC_", "TORCHELASTIC_", "LAUNCH_"];
    let names = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ];
    let more = [
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "RUST_LOG",
        "HF_ENDPOINT",
    ];
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().to_string();
        let drop = prefixes.iter().any(|p| key.starts_with(p)) || names.contains(&key.as_str());
        if drop || more.contains(&key.as_str()) {
            cmd.env_remove(&key);
        }
    }
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.arg("-c")
        .arg(format!("exec 2>&1\n{command}"))
        .env("PATH", format!("{}:{path}", bin_dir().display()))
        .env("GPTREC_CACHE", scratch.join("cache"))
        .current_dir(scratch)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    wait_output(cmd.spawn().expect("start bash"), Duration::from_secs(300)).stdout
}

/// Runs every console block of `file` in order, in one scratch directory; the mismatches.
fn check_console_blocks(file: &Path) -> Vec<String> {
    let scratch = tempfile::tempdir().expect("scratch directory");
    let configs = scratch.path().join("configs");
    std::os::unix::fs::symlink(repo_root().join("configs"), configs).expect("link configs/");
    let mut errors = Vec::new();
    for block in blocks(&read(file))
        .into_iter()
        .filter(|b| b.lang == "console")
    {
        let steps = match steps(&block) {
            Ok(steps) => steps,
            Err(e) => {
                errors.push(format!("{}:{}: {e}", rel(file), block.line));
                continue;
            }
        };
        for step in steps {
            let printed = run_step(&step.command, scratch.path());
            let actual: Vec<&str> = printed.trim_end().lines().map(str::trim_end).collect();
            if !lines_match(&step.expected, &actual) {
                let (at, command) = (format!("{}:{}", rel(file), step.line), &step.command);
                let (printed, shown) = (actual.join("\n"), step.expected.join("\n"));
                errors.push(format!(
                    "{at}: `$ {command}` printed:\n{printed}\n--- but the block shows:\n{shown}\n"
                ));
            }
        }
    }
    errors
}

#[test]
fn console_blocks_print_what_they_show() {
    assert_none(
        doc_files()
            .iter()
            .flat_map(|f| check_console_blocks(f))
            .collect(),
    );
}

/// Why the ```sh block `block` of `file` is not covered by the files its `run by` names.
fn run_by_errors(file: &Path, block: &Block) -> Vec<String> {
    let at = format!("{}:{}", rel(file), block.line);
    let Some(names) = &block.run_by else {
        return vec![format!("{at}: a ```{} block must follow `<!-- run by: FILE -->` (the test or CI script that runs it), or be a ```console block", block.lang)];
    };
    let mut runners = Vec::new();
    let mut errors = Vec::new();
    for name in names {
        let path = repo_root().join(name);
        let place = ["tests/", "scripts/", ".ci/"]
            .iter()
            .any(|p| name.starts_with(p));
        match place && path.is_file() {
            true => runners.push(joined(&read(&path))),
            false => errors.push(format!(
                "{at}: run by {name}: no such file in tests/, scripts/, .ci/"
            )),
        }
    }
    for command in joined(&block.body.join("\n")).lines() {
        let command = command.split(" # ").next().unwrap_or_default().trim();
        if !command.is_empty()
            && !command.starts_with('#')
            && !runners.iter().any(|r| r.contains(command))
        {
            errors.push(format!(
                "{at}: `{command}` is not in {}",
                names.join(" or ")
            ));
        }
    }
    errors
}

#[test]
fn every_command_block_is_run_here_or_names_what_runs_it() {
    let mut errors = Vec::new();
    let mut counts = [0, 0];
    for file in doc_files() {
        for block in blocks(&read(&file)) {
            match block.lang.as_str() {
                "console" => {
                    counts[0] += 1;
                    let e = steps(&block)
                        .err()
                        .map(|e| format!("{}:{}: {e}", rel(&file), block.line));
                    errors.extend(e);
                }
                "sh" | "bash" | "shell" => {
                    counts[1] += 1;
                    errors.extend(run_by_errors(&file, &block));
                }
                _ => {}
            }
        }
    }
    assert!(
        counts[0] > 10 && counts[1] > 3,
        "console and sh blocks: {counts:?}"
    );
    assert_none(errors);
}

// ---------------------------------------------------------------------------------------------
// (d) Figures name their script and date; links resolve.

/// Whether `word` is a date, `YYYY-MM-DD`.
fn is_date(word: &str) -> bool {
    let parts: Vec<&str> = word.split('-').collect();
    let number = |i: usize, len: usize| {
        let part = parts
            .get(i)
            .filter(|p| p.len() == len && p.bytes().all(|b| b.is_ascii_digit()));
        part.map_or(0, |p| p.parse::<u32>().unwrap_or(0))
    };
    parts.len() == 3
        && number(0, 4) > 0
        && (1..=12).contains(&number(1, 2))
        && (1..=31).contains(&number(2, 2))
}

/// Whether `text` names an existing `scripts/...` file and a date.
fn names_script_and_date(text: &str) -> bool {
    let words = text.split(|c: char| !(c.is_ascii_alphanumeric() || "/._-".contains(c)));
    let (mut script, mut date) = (false, false);
    for word in words.map(|w| w.trim_end_matches('.')) {
        script |= word.starts_with("scripts/") && repo_root().join(word).is_file();
        date |= is_date(word);
    }
    script && date
}

#[test]
fn every_figure_names_the_script_and_the_date_that_produced_it() {
    let text = read(&repo_root().join("docs/figures.md"));
    let lines = prose(&text);
    let mut tables = 0;
    let mut errors = Vec::new();
    for (k, &(n, line)) in lines.iter().enumerate() {
        if !line.starts_with('|') || (k > 0 && lines[k - 1].1.starts_with('|')) {
            continue;
        }
        tables += 1;
        // The paragraph just before the table (its last 6 lines at most).
        let above = lines[..k]
            .iter()
            .rev()
            .skip_while(|(_, l)| l.trim().is_empty());
        let paragraph: Vec<&str> = above
            .take_while(|(_, l)| !l.trim().is_empty())
            .take(6)
            .map(|(_, l)| *l)
            .collect();
        if !names_script_and_date(&paragraph.join(" ")) {
            errors.push(format!("docs/figures.md:{n}: the paragraph before this table must name the scripts/... file that produced it and the date (YYYY-MM-DD)"));
        }
    }
    assert!(tables >= 10, "docs/figures.md: {tables} tables");
    assert_none(errors);
}

/// Why the relative link `target` in `file` does not resolve.
fn link_error(file: &Path, target: &str) -> Option<String> {
    let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
    let dest = match path {
        "" => file.to_path_buf(),
        path => file.parent().expect("dir").join(path),
    };
    if !dest.exists() {
        return Some(format!("{} does not exist", rel(&dest)));
    }
    let found = anchor.is_empty() || anchors(&read(&dest)).contains(anchor);
    (!found).then(|| format!("no heading #{anchor} in {}", rel(&dest)))
}

#[test]
fn relative_links_resolve() {
    let mut errors = Vec::new();
    let mut links = 0;
    for file in doc_files() {
        for (n, line) in prose(&read(&file)) {
            for (i, _) in line.match_indices("](") {
                let target = line[i + 2..].split(')').next().unwrap_or_default();
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                links += 1;
                let why = link_error(&file, target);
                errors
                    .extend(why.map(|why| format!("{}:{n}: link to {target}: {why}", rel(&file))));
            }
        }
    }
    assert!(links > 10, "{links} relative links");
    assert_none(errors);
}
