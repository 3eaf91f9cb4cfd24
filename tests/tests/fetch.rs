//! `fetch` against a small HTTP/1.1 server on 127.0.0.1 written here (HEAD, Range, redirects,
//! cut connections, stalls), serving zips in GroupLens' layout and a tiny GPT-2 (`config.json`
//! and `model.safetensors`) as the Hugging Face hub does: a 302 with `X-Linked-Etag` and
//! `X-Linked-Size` to another host, or to a relative `Location`. Every case checks the exit
//! code, the one-line message, and that the final directory is absent or complete.

mod support;

use std::collections::HashMap;
use std::fs;
use std::io::{Cursor, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use sha2::{Digest, Sha256};
use support::*;

// ---------------------------------------------------------------------------------------------
// The test server.

/// What the server answers at one path (the query string is ignored).
#[derive(Clone)]
enum Route {
    /// A file, with Range support and extra headers.
    File(Arc<Vec<u8>>, Vec<(String, String)>),
    /// A redirect to `location`, with extra headers.
    Redirect(u16, String, Vec<(String, String)>),
    /// Headers of a file of this length, then silence.
    Stall(usize),
    /// A file served whole (200) whatever the Range asks.
    IgnoreRange(Arc<Vec<u8>>),
    /// A file (200, its whole length announced) sent one byte at a time, this far apart.
    Trickle(Arc<Vec<u8>>, Duration),
}

/// One request the server saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    range: Option<String>,
}

#[derive(Default)]
struct State {
    routes: HashMap<String, Route>,
    seen: Vec<Seen>,
    /// Path -> the next GETs of it send only this many body bytes, then close.
    cuts: HashMap<String, Vec<usize>>,
}

struct Server {
    port: u16,
    state: Arc<Mutex<State>>,
}

impl Server {
    fn start() -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the test server");
        let port = listener.local_addr().unwrap().port();
        let state: Arc<Mutex<State>> = Arc::default();
        let shared = state.clone();
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let state = shared.clone();
                thread::spawn(move || serve(stream, &state));
            }
        });
        Server { port, state }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn route(&self, path: &str, route: Route) {
        self.state.lock().unwrap().routes.insert(path.into(), route);
    }

    fn file(&self, path: &str, body: &[u8]) {
        self.route(path, Route::File(Arc::new(body.to_vec()), vec![]));
    }

    /// The next GET of `path` sends only `bytes` of the body, then closes the connection.
    fn cut_next(&self, path: &str, bytes: usize) {
        self.state
            .lock()
            .unwrap()
            .cuts
            .entry(path.into())
            .or_default()
            .push(bytes);
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }
}

fn serve(mut stream: TcpStream, state: &Mutex<State>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let Some((method, path, headers)) = read_request(&mut stream) else {
        return;
    };
    let route_path = path.split('?').next().unwrap_or("").to_string();
    let range = headers.get("range").cloned();
    let (route, cut) = {
        let mut s = state.lock().unwrap();
        s.seen.push(Seen {
            method: method.clone(),
            path: path.clone(),
            range: range.clone(),
        });
        let cut = match method.as_str() {
            "GET" => s
                .cuts
                .get_mut(&route_path)
                .and_then(|c| (!c.is_empty()).then(|| c.remove(0))),
            _ => None,
        };
        (s.routes.get(&route_path).cloned(), cut)
    };
    let head_only = method == "HEAD";
    match route {
        None => respond(&mut stream, "404 Not Found", &[], b"not here", head_only),
        Some(Route::Redirect(code, location, extra)) => {
            let mut h = extra.clone();
            h.push(("Location".into(), location));
            respond(&mut stream, &format!("{code} Found"), &h, b"", head_only);
        }
        Some(Route::File(body, extra)) => {
            serve_file(&mut stream, &body, &extra, range, cut, head_only)
        }
        Some(Route::IgnoreRange(body)) => respond(&mut stream, "200 OK", &[], &body, head_only),
        Some(Route::Trickle(body, every)) => {
            write_head(&mut stream, "200 OK", &[], body.len());
            for byte in body.iter() {
                if stream.write_all(&[*byte]).is_err() {
                    break;
                }
                thread::sleep(every);
            }
        }
        Some(Route::Stall(len)) => {
            let head =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n");
            let _ = stream.write_all(head.as_bytes());
            thread::sleep(Duration::from_secs(10));
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Method, path and lowercase headers of one request.
fn read_request(stream: &mut TcpStream) -> Option<(String, String, HashMap<String, String>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") && buf.len() < 16 * 1024 {
        if stream.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, path) = (first.next()?.to_string(), first.next()?.to_string());
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some((method, path, headers))
}

fn serve_file(
    stream: &mut TcpStream,
    body: &[u8],
    extra: &[(String, String)],
    range: Option<String>,
    cut: Option<usize>,
    head_only: bool,
) {
    let len = body.len();
    let start = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    let mut h = extra.to_vec();
    h.push(("Accept-Ranges".into(), "bytes".into()));
    let (status, from) = match start {
        Some(n) if n >= len => {
            h.push(("Content-Range".into(), format!("bytes */{len}")));
            return respond(stream, "416 Range Not Satisfiable", &h, b"", head_only);
        }
        Some(n) => {
            h.push((
                "Content-Range".into(),
                format!("bytes {n}-{}/{len}", len - 1),
            ));
            ("206 Partial Content", n)
        }
        None => ("200 OK", 0),
    };
    let rest = &body[from..];
    match cut {
        Some(n) => {
            write_head(stream, status, &h, rest.len());
            let _ = stream.write_all(&rest[..n.min(rest.len())]);
            let _ = stream.flush();
        }
        None => respond(stream, status, &h, rest, head_only),
    }
}

fn write_head(stream: &mut TcpStream, status: &str, headers: &[(String, String)], len: usize) {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {len}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
}

fn respond(
    stream: &mut TcpStream,
    status: &str,
    headers: &[(String, String)],
    body: &[u8],
    head_only: bool,
) {
    write_head(stream, status, headers, body.len());
    if !head_only {
        let _ = stream.write_all(body);
    }
    let _ = stream.flush();
}

// ---------------------------------------------------------------------------------------------
// Fixtures.

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Bytes that do not compress (so a stored zip is as large as its files).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A zip in GroupLens' layout (`ml-1m/ratings.dat` ...), with `extra` bytes of noise in its
/// README so its size can be chosen.
fn movielens_zip(extra: usize) -> Vec<u8> {
    use zip::write::SimpleFileOptions;
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let stored = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.add_directory("ml-1m/", stored).unwrap();
    let files: [(&str, Vec<u8>); 4] = [
        (
            "ratings.dat",
            b"1::1193::5::978300760\n1::661::3::978302109\n".to_vec(),
        ),
        ("users.dat", b"1::F::1::10::48067\n".to_vec()),
        (
            "movies.dat",
            b"1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n".to_vec(),
        ),
        ("README", noise(extra, 7)),
    ];
    for (name, data) in files {
        w.start_file(format!("ml-1m/{name}"), stored).unwrap();
        w.write_all(&data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

const CONFIG: &[u8] = br#"{"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 4}"#;

/// A whole safetensors file of one f32 tensor with `n` values.
fn safetensors(n: usize) -> Vec<u8> {
    let header = format!(
        r#"{{"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#,
        n * 4
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(noise(n * 4, 3));
    bytes
}

/// A manifest with `ml-1m` at `url`, `size` bytes, `sha256`.
fn manifest(dir: &Path, url: &str, size: usize, sha256: &str) -> PathBuf {
    manifest_of(dir, "ml-1m", url, size, sha256)
}

/// A manifest with the data set `name` at `url`, `size` bytes, `sha256`.
fn manifest_of(dir: &Path, name: &str, url: &str, size: usize, sha256: &str) -> PathBuf {
    let path = dir.join("manifest.toml");
    let text = format!(
        "[[entry]]\nname = \"{name}\"\nurl = \"{url}\"\nsize = {size}\nsha256 = \"{sha256}\"\n"
    );
    fs::write(&path, text).unwrap();
    path
}

/// A zip in GroupLens' ml-100k layout (`ml-100k/u.data` ...).
fn ml100k_zip() -> Vec<u8> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default();
    let files: [(&str, &[u8]); 4] = [
        (
            "u.data",
            b"196\t242\t3\t881250949\n186\t302\t3\t891717742\n",
        ),
        ("u.item", b"242|Kolya (1996)|24-Jan-1997||http://x|0|0|0\n"),
        ("u.user", b"196|49|M|writer|55105\n"),
        ("README", b"MovieLens-100k, in small"),
    ];
    for (name, data) in files {
        w.start_file(format!("ml-100k/{name}"), opts).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// A cache directory, a served ml-1m zip of about `size` bytes and its manifest.
struct DataCase {
    tmp: tempfile::TempDir,
    server: Server,
    zip: Vec<u8>,
    manifest: PathBuf,
}

impl DataCase {
    fn new(extra: usize) -> DataCase {
        let tmp = tempfile::tempdir().unwrap();
        let server = Server::start();
        let zip = movielens_zip(extra);
        server.file("/ml/ml-1m.zip", &zip);
        let manifest = manifest(
            tmp.path(),
            &server.url("/ml/ml-1m.zip"),
            zip.len(),
            &sha256_hex(&zip),
        );
        DataCase {
            tmp,
            server,
            zip,
            manifest,
        }
    }

    fn cache(&self) -> PathBuf {
        self.tmp.path().join("cache")
    }

    fn final_dir(&self) -> PathBuf {
        self.cache().join("data/ml-1m")
    }

    fn part(&self) -> PathBuf {
        self.cache().join(".partial/ml-1m/ml-1m.zip.part")
    }

    fn fetch(&self, env: &[(&str, &str)], args: &[&str]) -> Output {
        let cache = self.cache();
        let mut all = vec!["--cache", cache.to_str().unwrap()];
        all.extend(["--manifest", self.manifest.to_str().unwrap()]);
        all.extend(args);
        fetch(env, &all)
    }
}

// ---------------------------------------------------------------------------------------------
// Running `fetch` and checking what it left.

/// Runs `fetch ARGS` with no proxy and no cache variables but `env`.
fn fetch(env: &[(&str, &str)], args: &[&str]) -> Output {
    fetch_within(env, args, Duration::from_secs(60))
}

/// [`fetch`], killed after `timeout`.
fn fetch_within(env: &[(&str, &str)], args: &[&str], timeout: Duration) -> Output {
    let mut cmd = Command::new(bin("fetch"));
    for key in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"] {
        cmd.env_remove(key).env_remove(key.to_ascii_lowercase());
    }
    for key in [
        "GPTREC_CACHE",
        "HF_ENDPOINT",
        "GPTREC_GROUPLENS_URL",
        "GPTREC_FETCH_RETRIES",
    ] {
        cmd.env_remove(key);
    }
    cmd.envs(env.iter().copied())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    wait_output(cmd.spawn().expect("start fetch"), timeout)
}

/// The last line of stderr (the error line).
fn last_line(out: &Output) -> String {
    out.stderr.lines().last().unwrap_or("").to_string()
}

/// Panics unless `dir` is absent, or complete: its `.complete` marker and `files`.
#[track_caller]
fn assert_absent_or_complete(dir: &Path, files: &[&str]) {
    if !dir.exists() {
        return;
    }
    assert!(
        dir.join(".complete").is_file(),
        "{} has no marker",
        dir.display()
    );
    for f in files {
        assert!(dir.join(f).is_file(), "{} has no {f}", dir.display());
    }
}

const ML1M_FILES: [&str; 4] = ["ratings.dat", "users.dat", "movies.dat", "README"];

/// Panics unless `dir` holds the fixture's ml-1m files, flat, and its marker.
#[track_caller]
fn assert_ml1m_placed(dir: &Path, zip: &[u8]) {
    assert_absent_or_complete(dir, &ML1M_FILES);
    assert!(dir.is_dir(), "{} is missing", dir.display());
    assert!(fs::read_to_string(dir.join("ratings.dat"))
        .unwrap()
        .starts_with("1::1193::5"));
    let marker = fs::read_to_string(dir.join(".complete")).unwrap();
    assert!(marker.contains(&sha256_hex(zip)), "{marker}");
    assert!(
        !dir.join("ml-1m").exists(),
        "the zip's top folder is dropped"
    );
}

/// Entries of `dir` whose names start with a dot, other than `.complete` (staging leftovers).
fn hidden_leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Data sets.

#[test]
fn a_data_zip_is_downloaded_unpacked_and_then_already_there() {
    let case = DataCase::new(1000);
    let out = case.fetch(&[], &["ml-1m"]);
    out.assert_code(0);
    out.assert_stderr(format!(
        "fetch: ml-1m ready in {}",
        case.final_dir().display()
    ));
    assert_ml1m_placed(&case.final_dir(), &case.zip);
    assert!(
        !case.part().exists(),
        "the partial download is removed once placed"
    );
    assert!(hidden_leftovers(&case.cache().join("data")).is_empty());

    let again = case.fetch(&[], &["ml-1m"]);
    again.assert_code(0);
    assert_eq!(
        last_line(&again),
        format!("fetch: ml-1m already in {}", case.final_dir().display())
    );
    let gets = case
        .server
        .seen()
        .iter()
        .filter(|s| s.method == "GET")
        .count();
    assert_eq!(gets, 1, "nothing is downloaded again");
}

#[test]
fn a_cut_download_resumes_with_range_on_the_rerun() {
    let case = DataCase::new(200_000);
    case.server.cut_next("/ml/ml-1m.zip", 50_000);
    let out = case.fetch(&[("GPTREC_FETCH_RETRIES", "0")], &["ml-1m"]);
    out.assert_code(1);
    let line = last_line(&out);
    assert!(
        line.contains("the connection closed before the end"),
        "{line}"
    );
    assert!(
        line.contains("50000 of") && line.contains("rerun to resume"),
        "{line}"
    );
    assert!(!case.final_dir().exists(), "nothing is placed after a cut");
    assert_eq!(fs::metadata(case.part()).unwrap().len(), 50_000);

    let again = case.fetch(&[("GPTREC_FETCH_RETRIES", "0")], &["ml-1m"]);
    again.assert_code(0);
    let seen = case.server.seen();
    assert_eq!(
        seen.last().and_then(|s| s.range.clone()).as_deref(),
        Some("bytes=50000-"),
        "{seen:?}"
    );
    assert_ml1m_placed(&case.final_dir(), &case.zip);
}

#[test]
fn a_cut_download_resumes_within_one_run() {
    let case = DataCase::new(200_000);
    case.server.cut_next("/ml/ml-1m.zip", 30_000);
    let out = case.fetch(&[], &["ml-1m"]);
    out.assert_code(0);
    out.assert_stderr("resuming (retry 1 of 3)");
    let ranges: Vec<_> = case
        .server
        .seen()
        .into_iter()
        .filter_map(|s| s.range)
        .collect();
    assert_eq!(ranges, ["bytes=30000-"]);
    assert_ml1m_placed(&case.final_dir(), &case.zip);
}

#[test]
fn a_server_that_ignores_range_makes_the_rerun_start_over() {
    let case = DataCase::new(200_000);
    case.server.cut_next("/ml/ml-1m.zip", 50_000);
    let env = [("GPTREC_FETCH_RETRIES", "0")];
    case.fetch(&env, &["ml-1m"]).assert_code(1);
    case.server.route(
        "/ml/ml-1m.zip",
        Route::IgnoreRange(Arc::new(case.zip.clone())),
    );
    let out = case.fetch(&env, &["ml-1m"]);
    out.assert_code(0);
    let ranges: Vec<_> = case
        .server
        .seen()
        .into_iter()
        .filter_map(|s| s.range)
        .collect();
    assert_eq!(
        ranges,
        ["bytes=50000-"],
        "it asked for the rest and got the whole file"
    );
    assert_ml1m_placed(&case.final_dir(), &case.zip);
}

#[test]
fn a_wrong_checksum_fails_and_deletes_the_download() {
    let case = DataCase::new(1000);
    let wrong = sha256_hex(b"something else");
    let manifest = manifest(
        case.tmp.path(),
        &case.server.url("/ml/ml-1m.zip"),
        case.zip.len(),
        &wrong,
    );
    let cache = case.cache();
    let out = fetch(
        &[],
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--manifest",
            manifest.to_str().unwrap(),
            "ml-1m",
        ],
    );
    out.assert_code(1);
    let expected = format!(
        "fetch: checksum mismatch for ml-1m.zip: expected sha256 {wrong}, got {}; the download was deleted, rerun to start over",
        sha256_hex(&case.zip)
    );
    assert_eq!(last_line(&out), expected);
    assert!(!case.final_dir().exists());
    assert!(
        !case.part().exists(),
        "a download that failed its check is deleted"
    );
}

#[test]
fn a_404_names_the_url() {
    let case = DataCase::new(10);
    let missing = case.server.url("/ml/nothing.zip");
    let manifest = manifest(case.tmp.path(), &missing, 100, &sha256_hex(b"x"));
    let cache = case.cache();
    let out = fetch(
        &[],
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--manifest",
            manifest.to_str().unwrap(),
            "ml-1m",
        ],
    );
    out.assert_code(1);
    assert_eq!(
        last_line(&out),
        format!("fetch: {missing} answered HTTP 404 Not Found")
    );
    assert!(!case.final_dir().exists());
}

#[test]
fn offline_names_the_host_and_how_to_fetch_by_hand() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}/ml-1m.zip");
    let tmp = tempfile::tempdir().unwrap();
    let manifest = manifest(tmp.path(), &url, 100, &sha256_hex(b"x"));
    let cache = tmp.path().join("cache");
    let out = fetch(
        &[],
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--manifest",
            manifest.to_str().unwrap(),
            "ml-1m",
        ],
    );
    out.assert_code(1);
    let line = last_line(&out);
    assert!(
        line.starts_with(&format!(
            "fetch: cannot reach 127.0.0.1:{port} (offline?): "
        )),
        "{line}"
    );
    assert!(
        line.ends_with(&format!(
            "; download {url} on another machine and run: fetch --from FILE ml-1m"
        )),
        "{line}"
    );
    assert!(!cache.join("data/ml-1m").exists());
    out.assert_ended_within(10);
}

#[test]
fn a_stalled_server_times_out() {
    let case = DataCase::new(10);
    case.server
        .route("/ml/ml-1m.zip", Route::Stall(case.zip.len()));
    let out = case.fetch(
        &[
            ("GPTREC_FETCH_STALL_SECS", "1"),
            ("GPTREC_FETCH_RETRIES", "0"),
        ],
        &["ml-1m"],
    );
    out.assert_code(1);
    let line = last_line(&out);
    assert!(line.contains("no data for 1 s (stalled)"), "{line}");
    assert!(!case.final_dir().exists());
    out.assert_ended_within(8);
}

/// A placed data set whose files no longer match its marker: a file of another size or a
/// missing one is caught on every use (`--list`, `fetch NAME`), one of the same size by
/// `--verify`; each is named in one line and the data set is fetched again. (Before, the
/// marker alone was trusted: `already in`, and `--list` said present.)
#[test]
fn a_placement_whose_files_changed_is_named_and_fetched_again() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start();
    let zip = ml100k_zip();
    server.file("/ml/ml-100k.zip", &zip);
    let url = server.url("/ml/ml-100k.zip");
    let manifest = manifest_of(tmp.path(), "ml-100k", &url, zip.len(), &sha256_hex(&zip));
    let cache = tmp.path().join("cache");
    let dir = cache.join("data/ml-100k");
    let run = |args: &[&str]| {
        let mut all = vec!["--cache", cache.to_str().unwrap()];
        all.extend(["--manifest", manifest.to_str().unwrap()]);
        all.extend(args);
        fetch(&[], &all)
    };
    let gets = || server.seen().iter().filter(|s| s.method == "GET").count();
    run(&["ml-100k"]).assert_code(0);
    let u_data = fs::read(dir.join("u.data")).unwrap();

    fs::write(dir.join("u.data"), b"changed\n").unwrap();
    fs::remove_file(dir.join("u.item")).unwrap();
    let list = run(&["--list"]);
    list.assert_code(0);
    let listed = format!("ml-100k      modified   {}", dir.display());
    assert!(list.stdout.contains(&listed), "{}", list.stdout);
    let said = format!(
        "fetch: {}: 8 bytes, its .complete marker records {} (and 1 more file differs)",
        dir.join("u.data").display(),
        u_data.len()
    );
    list.assert_stderr(&said);

    let out = run(&["ml-100k"]);
    out.assert_code(0);
    out.assert_stderr(format!("{said}; ml-100k is placed again"));
    assert_eq!(
        last_line(&out),
        format!("fetch: ml-100k ready in {}", dir.display())
    );
    assert_eq!(fs::read(dir.join("u.data")).unwrap(), u_data);
    assert!(dir.join("u.item").is_file());
    assert_eq!(gets(), 2);

    // The same size, other bytes: only --verify (which hashes every file) sees it.
    let mut flipped = u_data.clone();
    flipped[0] ^= 1;
    fs::write(dir.join("u.data"), &flipped).unwrap();
    let out = run(&["ml-100k"]);
    assert_eq!(
        last_line(&out),
        format!("fetch: ml-100k already in {}", dir.display())
    );
    let out = run(&["--verify", "ml-100k"]);
    out.assert_code(0);
    out.assert_stderr(format!(
        "fetch: {}: sha256 {}, its .complete marker records {}; ml-100k is placed again",
        dir.join("u.data").display(),
        sha256_hex(&flipped),
        sha256_hex(&u_data)
    ));
    assert_eq!(fs::read(dir.join("u.data")).unwrap(), u_data);
    assert_eq!(gets(), 3);

    let out = run(&["--verify", "ml-100k"]);
    out.assert_code(0);
    out.assert_stderr("fetch: ml-100k: 4 files match the SHA-256 in its .complete marker");
    assert_eq!(
        last_line(&out),
        format!("fetch: ml-100k already in {}", dir.display())
    );
    assert_eq!(
        gets(),
        3,
        "nothing is downloaded for a placement that matches"
    );
}

/// A server that sends one byte every 0.4 s never stalls for a whole second, yet the transfer
/// is cut once it falls behind the floor rate: one line naming the URL, the bytes received,
/// the time and the floor, within seconds (the trickle would take minutes), and the bytes that
/// did arrive are kept for a resume. (Before, only the stall check applied: it ran until the
/// test's deadline killed it.)
#[test]
fn a_trickling_server_is_cut_at_the_floor_rate() {
    let case = DataCase::new(10);
    let url = case.server.url("/ml/ml-1m.zip");
    case.server.route(
        "/ml/ml-1m.zip",
        Route::Trickle(Arc::new(case.zip.clone()), Duration::from_millis(400)),
    );
    let cache = case.cache();
    let args = [
        "--cache",
        cache.to_str().unwrap(),
        "--manifest",
        case.manifest.to_str().unwrap(),
        "ml-1m",
    ];
    let env = [
        ("GPTREC_FETCH_STALL_SECS", "1"),
        ("GPTREC_FETCH_RETRIES", "0"),
    ];
    let out = fetch_within(&env, &args, Duration::from_secs(20));
    out.assert_ended_within(6);
    out.assert_code(1);
    let line = last_line(&out);
    let kept = fs::metadata(case.part()).map_or(0, |m| m.len());
    assert!(kept > 0, "the bytes that arrived are kept");
    let expected = format!("fetch: download of {url} failed: too slow: {kept} bytes in ");
    assert!(line.starts_with(&expected), "{line}");
    assert!(
        line.contains(" s, below the floor of 64 KiB/s")
            && line.ends_with(&format!(
                "; {kept} of {} bytes kept, rerun to resume",
                case.zip.len()
            )),
        "{line}"
    );
    assert!(!case.final_dir().exists());
}

/// A tmpfs of `size` at a new directory, unmounted when dropped; `None` (with a line saying
/// why) where mounting is not allowed.
struct Tmpfs {
    mnt: PathBuf,
    /// Holds the mount point's parent until after the unmount.
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let opts = format!("size={size}");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &opts, "tmpfs"])
            .arg(&mnt)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs { mnt, _dir: dir })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

#[test]
fn a_full_disk_places_nothing_and_says_so() {
    let case = DataCase::new(200_000);
    let Some(tmpfs) = Tmpfs::mount("64k") else {
        println!("skipped: cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)");
        return;
    };
    let cache = tmpfs.mnt.join("cache");
    let out = fetch(
        &[],
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--manifest",
            case.manifest.to_str().unwrap(),
            "ml-1m",
        ],
    );
    out.assert_code(1);
    let final_dir = cache.join("data/ml-1m");
    let expected = format!(
        "fetch: disk full writing {}: no space left on device; nothing was placed in {}",
        cache.join(".partial/ml-1m/ml-1m.zip.part").display(),
        final_dir.display()
    );
    assert_eq!(last_line(&out), expected);
    assert!(!final_dir.exists());
}

#[test]
fn from_file_installs_a_hand_downloaded_zip_without_network() {
    let tmp = tempfile::tempdir().unwrap();
    let zip = movielens_zip(100);
    let file = tmp.path().join("ml-1m.zip");
    fs::write(&file, &zip).unwrap();
    // The manifest's URL goes nowhere: --from must not use it.
    let dead = format!("http://127.0.0.1:{}/ml-1m.zip", free_port());
    let manifest = manifest(tmp.path(), &dead, zip.len(), &sha256_hex(&zip));
    let cache = tmp.path().join("cache");
    let args = |from: &Path| {
        let v: Vec<String> = [
            "--cache",
            cache.to_str().unwrap(),
            "--manifest",
            manifest.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(["--from".into(), from.display().to_string(), "ml-1m".into()])
        .collect();
        v
    };

    let bad = tmp.path().join("bad.zip");
    fs::write(&bad, movielens_zip(101)).unwrap();
    let a = args(&bad);
    let out = fetch(&[], &a.iter().map(String::as_str).collect::<Vec<_>>());
    out.assert_code(1);
    let line = last_line(&out);
    assert!(
        line.starts_with("fetch: size mismatch for ml-1m.zip: expected"),
        "{line}"
    );
    assert!(bad.exists(), "the user's file is never deleted");
    assert!(!cache.join("data/ml-1m").exists());

    let a = args(&file);
    let out = fetch(&[], &a.iter().map(String::as_str).collect::<Vec<_>>());
    out.assert_code(0);
    assert_eq!(
        last_line(&out),
        format!(
            "fetch: ml-1m ready in {}",
            cache.join("data/ml-1m").display()
        )
    );
    assert_ml1m_placed(&cache.join("data/ml-1m"), &zip);
    assert!(file.exists(), "the user's file stays");
}

// ---------------------------------------------------------------------------------------------
// Models.

/// Serves a tiny GPT-2 at `repo` the way the hub does: config.json directly, model.safetensors
/// as a 302 carrying X-Linked-Etag / X-Linked-Size to `location`, where `cas` serves it.
fn serve_model(hub: &Server, cas: &Server, repo: &str, location: &str, weights: &[u8]) {
    hub.file(&format!("/{repo}/resolve/main/config.json"), CONFIG);
    let sha = sha256_hex(weights);
    let headers = vec![
        ("X-Linked-Etag".to_string(), format!("\"{sha}\"")),
        ("x-linked-size".to_string(), weights.len().to_string()),
        ("ETag".to_string(), format!("W/\"{sha}\"")),
    ];
    hub.route(
        &format!("/{repo}/resolve/main/model.safetensors"),
        Route::Redirect(302, location.to_string(), headers),
    );
    let path = location
        .split("://")
        .nth(1)
        .map_or(location, |rest| &rest[rest.find('/').unwrap_or(0)..]);
    cas.file(path.split('?').next().unwrap(), weights);
}

#[track_caller]
fn assert_model_placed(dir: &Path, weights: &[u8]) {
    assert_absent_or_complete(dir, &["config.json", "model.safetensors"]);
    assert_eq!(fs::read(dir.join("config.json")).unwrap(), CONFIG);
    assert_eq!(fs::read(dir.join("model.safetensors")).unwrap(), weights);
    let marker = fs::read_to_string(dir.join(".complete")).unwrap();
    assert!(marker.contains(&sha256_hex(weights)), "{marker}");
}

#[test]
fn a_model_comes_through_the_hubs_redirect_to_another_host() {
    let (hub, cas) = (Server::start(), Server::start());
    let weights = safetensors(20_000);
    let location = cas.url("/cas/xet/abc?X-Amz-Signature=zzz");
    serve_model(&hub, &cas, "openai-community/gpt2", &location, &weights);
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let out = fetch(
        &[("HF_ENDPOINT", format!("{}/", hub.url("")).as_str())],
        &["--cache", cache.to_str().unwrap(), "gpt2"],
    );
    out.assert_code(0);
    let dir = cache.join("models/gpt2");
    assert_eq!(
        last_line(&out),
        format!("fetch: gpt2 ready in {}", dir.display())
    );
    assert_model_placed(&dir, &weights);
    let hub_seen = hub.seen();
    assert!(
        hub_seen.iter().any(|s| s.method == "HEAD"
            && s.path == "/openai-community/gpt2/resolve/main/model.safetensors"),
        "{hub_seen:?}"
    );
    let cas_seen = cas.seen();
    assert!(
        cas_seen
            .iter()
            .any(|s| s.method == "GET" && s.path == "/cas/xet/abc?X-Amz-Signature=zzz"),
        "{cas_seen:?}"
    );
}

#[test]
fn a_model_follows_a_relative_location_and_resumes() {
    let hub = Server::start();
    let weights = safetensors(30_000);
    serve_model(
        &hub,
        &hub,
        "distilbert/distilgpt2",
        "/cas/distil?sig=1",
        &weights,
    );
    hub.cut_next("/cas/distil", 40_000);
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let env = [
        ("HF_ENDPOINT", hub.url("")),
        ("GPTREC_FETCH_RETRIES", "0".into()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let dir = cache.join("models/distilgpt2");

    let out = fetch(&env, &["--cache", cache.to_str().unwrap(), "distilgpt2"]);
    out.assert_code(1);
    assert!(
        last_line(&out).contains("rerun to resume"),
        "{}",
        out.stderr
    );
    assert!(!dir.exists());

    let out = fetch(&env, &["--cache", cache.to_str().unwrap(), "distilgpt2"]);
    out.assert_code(0);
    assert_model_placed(&dir, &weights);
    let ranges: Vec<_> = hub.seen().into_iter().filter_map(|s| s.range).collect();
    assert_eq!(ranges, ["bytes=40000-"]);
}

#[test]
fn a_model_whose_bytes_differ_from_the_hubs_digest_is_refused() {
    let (hub, cas) = (Server::start(), Server::start());
    let weights = safetensors(1000);
    serve_model(
        &hub,
        &cas,
        "openai-community/gpt2",
        &cas.url("/cas/w"),
        &weights,
    );
    let mut other = weights.clone();
    *other.last_mut().unwrap() ^= 1;
    cas.file("/cas/w", &other);
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let out = fetch(
        &[("HF_ENDPOINT", hub.url("").as_str())],
        &["--cache", cache.to_str().unwrap(), "gpt2"],
    );
    out.assert_code(1);
    let line = last_line(&out);
    assert!(
        line.starts_with("fetch: checksum mismatch for model.safetensors: expected sha256"),
        "{line}"
    );
    assert!(!cache.join("models/gpt2").exists());
}

/// A hand-made model directory without `config.json`: one line naming the directory and what
/// it lacks (it said "(os error 2)" twice).
#[test]
fn from_dir_without_config_json_says_what_is_missing_once() {
    let tmp = tempfile::tempdir().unwrap();
    let from = tmp.path().join("gpt2-by-hand");
    fs::create_dir(&from).unwrap();
    fs::write(from.join("model.safetensors"), safetensors(500)).unwrap();
    let cache = tmp.path().join("cache");
    let args = [
        "--cache",
        cache.to_str().unwrap(),
        "--from",
        from.to_str().unwrap(),
        "gpt2",
    ];
    let out = fetch(&[], &args);
    assert_ne!(out.code(), Some(0), "{}", out.stderr);
    let line = last_line(&out);
    assert!(
        line.contains(&from.display().to_string()) && line.contains("no config.json there"),
        "{line}"
    );
    assert!(!out.stderr.contains("os error"), "{}", out.stderr);
}

#[test]
fn from_dir_installs_a_hand_downloaded_model_and_refuses_a_cut_one() {
    let tmp = tempfile::tempdir().unwrap();
    let from = tmp.path().join("gpt2-by-hand");
    fs::create_dir(&from).unwrap();
    fs::write(from.join("config.json"), CONFIG).unwrap();
    let weights = safetensors(500);
    fs::write(
        from.join("model.safetensors"),
        &weights[..weights.len() - 4],
    )
    .unwrap();
    let cache = tmp.path().join("cache");
    let args = [
        "--cache",
        cache.to_str().unwrap(),
        "--from",
        from.to_str().unwrap(),
        "gpt2",
    ];
    // No HF_ENDPOINT: nothing may be downloaded.
    let out = fetch(&[], &args);
    out.assert_code(1);
    let line = last_line(&out);
    assert!(
        line.contains("model.safetensors: its tensors end at byte"),
        "{line}"
    );
    assert!(!cache.join("models/gpt2").exists());

    fs::write(from.join("model.safetensors"), &weights).unwrap();
    let out = fetch(&[], &args);
    out.assert_code(0);
    assert_model_placed(&cache.join("models/gpt2"), &weights);
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::S_IRWXU).unwrap();
}

/// A FIFO or a device handed to `--from` (as config.json, model.safetensors or the zip) is
/// refused at once, in one line naming the file and what it is: nothing waits on a FIFO with
/// no writer, nothing reads /dev/zero forever, nothing is placed.
#[test]
fn from_refuses_a_fifo_or_a_device_at_once_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let from = tmp.path().join("gpt2-by-hand");
    fs::create_dir(&from).unwrap();
    let cache = tmp.path().join("cache");
    let run = |from: &Path, name: &str| {
        let args = [
            "--cache",
            cache.to_str().unwrap(),
            "--from",
            from.to_str().unwrap(),
            name,
        ];
        fetch_within(&[], &args, Duration::from_secs(10))
    };
    let config = from.join("config.json");
    let weights = from.join("model.safetensors");
    fs::write(&weights, safetensors(100)).unwrap();
    mkfifo(&config);
    let out = run(&from, "gpt2");
    out.assert_code(1);
    assert_eq!(
        last_line(&out),
        format!("fetch: {}: is a FIFO, not a file", config.display())
    );
    out.assert_ended_within(5);

    fs::remove_file(&config).unwrap();
    fs::write(&config, CONFIG).unwrap();
    fs::remove_file(&weights).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &weights).unwrap();
    let out = run(&from, "gpt2");
    out.assert_code(1);
    assert_eq!(
        last_line(&out),
        format!("fetch: {}: is a device, not a file", weights.display())
    );
    out.assert_ended_within(5);
    assert!(!cache.join("models/gpt2").exists());

    let zip = tmp.path().join("ml-1m.zip");
    mkfifo(&zip);
    let out = run(&zip, "ml-1m");
    out.assert_code(1);
    assert_eq!(
        last_line(&out),
        format!("fetch: {}: is a FIFO, not a file", zip.display())
    );
    out.assert_ended_within(5);
    assert!(!cache.join("data/ml-1m").exists());
}

/// `model.safetensors` swapped, while `fetch --from DIR` runs, between two whole files and a
/// FIFO (a link renamed over it every few hundred microseconds): every run ends within
/// seconds, and what it places is one file whole, the one its marker's digest covers (it is
/// opened once; the header check, the digest and the copy read that one handle).
#[test]
fn from_dir_with_weights_swapped_meanwhile_never_hangs_or_mixes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let from = tmp.path().join("gpt2-by-hand");
    fs::create_dir(&from).unwrap();
    fs::write(from.join("config.json"), CONFIG).unwrap();
    let (a, b) = (safetensors(50_000), safetensors(40_000));
    let sources = [
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("f"),
    ];
    fs::write(&sources[0], &a).unwrap();
    fs::write(&sources[1], &b).unwrap();
    mkfifo(&sources[2]);
    let weights = from.join("model.safetensors");
    std::os::unix::fs::symlink(&sources[0], &weights).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (stop, weights, sources) = (stop.clone(), weights.clone(), sources.clone());
        let tmp_link = from.join(".swap");
        thread::spawn(move || {
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                // Errors ignored: the directory goes when a failing test unwinds.
                let _ = fs::remove_file(&tmp_link);
                let _ = std::os::unix::fs::symlink(&sources[i % 3], &tmp_link);
                let _ = fs::rename(&tmp_link, &weights);
                thread::sleep(Duration::from_micros(300));
            }
        })
    };
    let mut outcomes = Vec::new();
    for run in 0..8 {
        let cache = tmp.path().join(format!("cache{run}"));
        let args = [
            "--cache",
            cache.to_str().unwrap(),
            "--from",
            from.to_str().unwrap(),
            "gpt2",
        ];
        let out = fetch_within(&[], &args, Duration::from_secs(10));
        let dir = cache.join("models/gpt2");
        out.assert_ended_within(8);
        match out.code() {
            Some(0) => {
                let placed = fs::read(dir.join("model.safetensors")).unwrap();
                assert!(placed == a || placed == b, "a mix of files was placed");
                let marker = fs::read_to_string(dir.join(".complete")).unwrap();
                assert!(marker.contains(&sha256_hex(&placed)), "{marker}");
            }
            _ => {
                let line = last_line(&out);
                assert!(line.ends_with("is a FIFO, not a file"), "{}", out.stderr);
                assert!(!dir.exists());
            }
        }
        outcomes.push(out.code());
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    println!("exit codes: {outcomes:?}");
}

// ---------------------------------------------------------------------------------------------
// The command line.

#[test]
fn list_shows_each_name_and_whether_the_cache_has_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let placed = cache.join("data/ml-100k");
    fs::create_dir_all(&placed).unwrap();
    fs::write(
        placed.join(".complete"),
        r#"{"name":"ml-100k","source":"x","files":[]}"#,
    )
    .unwrap();
    fs::create_dir_all(cache.join("models/gpt2")).unwrap();
    let out = fetch(&[], &["--list", "--cache", cache.to_str().unwrap()]);
    out.assert_code(0);
    let line = |name: &str| {
        out.stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{}", out.stdout))
            .to_string()
    };
    assert!(
        line("ml-100k").contains(&format!("present    {}", placed.display())),
        "{}",
        out.stdout
    );
    assert!(line("ml-1m").contains("missing"), "{}", out.stdout);
    assert!(line("gpt2").contains("incomplete"), "{}", out.stdout);
    out.assert_stdout_all(&["MovieLens-1M", "distilgpt2", "gpt2-xl"]);
}

/// A data set written by hand into the cache (as scripts/data/ml100k.sh does, with no fetch
/// marker) is listed "by hand", and `fetch` keeps it instead of replacing it.
#[test]
fn a_data_set_placed_by_hand_is_listed_and_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let placed = cache.join("data/ml-100k");
    fs::create_dir_all(&placed).unwrap();
    for file in ["u.data", "u.item", "u.user"] {
        fs::write(placed.join(file), "1\t2\t3\t4\n").unwrap();
    }
    let out = fetch(&[], &["--list", "--cache", cache.to_str().unwrap()]);
    out.assert_code(0);
    let listed = format!("ml-100k      by hand    {}", placed.display());
    assert!(out.stdout.contains(&listed), "{}", out.stdout);
    // No network is reachable here: the data set is kept, nothing is downloaded.
    let out = fetch(&[], &["--cache", cache.to_str().unwrap(), "ml-100k"]);
    out.assert_code(0);
    out.assert_stderr("placed by hand");
    assert_eq!(
        fs::read_to_string(placed.join("u.data")).unwrap(),
        "1\t2\t3\t4\n"
    );
}

#[test]
fn an_unknown_name_is_bad_usage_listing_the_known_ones() {
    let out = fetch(&[], &["ml-2m"]);
    out.assert_code(2);
    assert_eq!(
        last_line(&out),
        "fetch: unknown name \"ml-2m\"; known names: ml-1m, ml-100k, gpt2, distilgpt2, gpt2-medium, gpt2-large, gpt2-xl"
    );
}

#[test]
fn help_describes_the_command() {
    let out = fetch(&[], &["--help"]);
    out.assert_code(0);
    out.assert_stdout_all(&[
        "Usage: fetch",
        "--list",
        "--from",
        "--cache",
        "--quiet",
        "--manifest",
        "HF_ENDPOINT",
    ]);
    let none = fetch(&[], &[]);
    none.assert_code(2);
}
