//! Headless Chromium, driven over the DevTools protocol: a minimal
//! WebSocket client (RFC 6455, text frames; enough for the protocol's JSON)
//! on a loopback port, so the tests need no crate beyond the workspace's.
//! Every wait is bounded.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use std::io::BufRead;
use std::process::{Child, Command};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest one DevTools command, or the browser's start, may take
/// (generous: a first start on a loaded machine is slow).
const WAIT: Duration = Duration::from_secs(90);

/// A headless Chromium and one page of it.
pub struct Browser {
    _process: Process,
    ws: TcpStream,
    next_id: u64,
    _profile: tempfile::TempDir,
}

/// The browser binary: `EGRESS_CHROMIUM`, else `chromium` on the `PATH`.
fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("EGRESS_CHROMIUM") {
        return Some(p.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("chromium"))
        .find(|p| p.is_file())
}

impl Browser {
    /// A fresh browser (its own profile directory) with a 1280×800 page,
    /// or `None` when there is no Chromium here (a skip; CI requires it).
    pub async fn start() -> Option<Self> {
        let Some(bin) = binary() else {
            egress_testkit::skip("the console's browser tests", "no chromium on the PATH");
            return None;
        };
        let profile = tempfile::tempdir().expect("profile dir");
        let mut child = Command::new(bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1280,800",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium starts");
        let stderr = child.stderr.take().expect("stderr");
        // Ended by PID from here on, a panic of the start included.
        let process = Process(child);
        let port = tokio::task::spawn_blocking(move || devtools_port(stderr))
            .await
            .expect("the stderr reader");
        let page = tokio::time::timeout(WAIT, page_socket(port))
            .await
            .unwrap_or_else(|_| panic!("no page target within {WAIT:?}"));
        let ws = tokio::time::timeout(WAIT, upgrade(port, &page))
            .await
            .unwrap_or_else(|_| panic!("no WebSocket upgrade within {WAIT:?}"));
        let mut b = Self {
            _process: process,
            ws,
            next_id: 0,
            _profile: profile,
        };
        b.call("Page.enable", json!({})).await;
        b.call("Runtime.enable", json!({})).await;
        Some(b)
    }

    /// One DevTools command; its `result` (events in between are skipped).
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        let answer = self.exchange(method, params).await;
        assert!(answer.get("error").is_none(), "{method}: {answer}");
        answer["result"].clone()
    }

    /// One DevTools command; the whole answer, an error included.
    async fn exchange(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        send(&mut self.ws, msg.as_bytes()).await;
        let answer = tokio::time::timeout(WAIT, async {
            loop {
                let text = receive(&mut self.ws).await;
                let v: Value = serde_json::from_slice(&text).expect("DevTools JSON");
                if v["id"] == json!(id) {
                    return v;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{method}: no answer within {WAIT:?}"));
        answer
    }

    /// Loads `url` in the page.
    pub async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    pub async fn eval(&mut self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        assert!(r.get("exceptionDetails").is_none(), "{expression}: {r}");
        r["result"]["value"].clone()
    }

    /// Polls `expression` until it is truthy (≤ 20 s); its value.
    pub async fn until(&mut self, expression: &str) -> Value {
        let wrapped =
            format!("(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()");
        for _ in 0..200 {
            // A page still loading may have no context to evaluate in yet.
            let p = json!({"expression": wrapped, "returnByValue": true});
            let v = self.exchange("Runtime.evaluate", p).await["result"]["result"]["value"].clone();
            if !(v.is_null() || v == json!(false) || v == json!("") || v == json!(0)) {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let text = self.eval("document.body.innerText").await;
        panic!("never true: {expression}\npage:\n{text}");
    }

    /// The page's visible text.
    pub async fn text(&mut self) -> String {
        self.eval("document.body.innerText")
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Presses and releases `Tab` or `Enter`, as a keyboard would.
    pub async fn key(&mut self, key: &str) {
        let (code, text) = match key {
            "Tab" => (9, ""),
            "Enter" => (13, "\r"),
            other => panic!("no key {other:?} here"),
        };
        for kind in ["keyDown", "keyUp"] {
            let mut p = json!({"type": kind, "key": key, "code": key,
                               "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code});
            if kind == "keyDown" && !text.is_empty() {
                p["text"] = json!(text);
            }
            self.call("Input.dispatchKeyEvent", p).await;
        }
    }

    /// Sets the viewport (narrow screens are `width` < 700).
    pub async fn viewport(&mut self, width: u32, height: u32) {
        let p = json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false});
        self.call("Emulation.setDeviceMetricsOverride", p).await;
    }

    /// A PNG of the viewport, written to `path`.
    pub async fn screenshot(&mut self, path: &std::path::Path) {
        use base64::Engine as _;
        let r = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().expect("data"))
            .expect("base64 PNG");
        std::fs::write(path, png).expect("write the screenshot");
    }
}

/// The browser's process, killed and reaped when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads Chromium's stderr (on a thread that drains it for the browser's
/// life) until `DevTools listening on ws://127.0.0.1:PORT/…` (≤ 90 s).
fn devtools_port(stderr: std::process::ChildStderr) -> u16 {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if let Some(rest) = line.split("ws://127.0.0.1:").nth(1) {
                let port = rest.split('/').next().unwrap_or_default().parse::<u16>();
                let _ = tx.send(port);
            }
        }
    });
    match rx.recv_timeout(WAIT) {
        Ok(Ok(port)) => port,
        Ok(Err(e)) => panic!("chromium announced an odd DevTools port: {e}"),
        Err(_) => panic!("chromium did not announce DevTools within {WAIT:?}"),
    }
}

/// One HTTP/1.1 request to the DevTools endpoint; the body (its
/// `Content-Length`: the browser keeps the connection open).
async fn get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let head = head_of(&mut s).await;
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .expect("a Content-Length");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.expect("body");
    String::from_utf8_lossy(&body).into_owned()
}

/// An HTTP answer's head, up to the empty line.
async fn head_of(s: &mut TcpStream) -> Vec<u8> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.expect("an answer");
        head.push(b[0]);
        assert!(head.len() < 8192, "an endless answer head");
    }
    head
}

/// The WebSocket path of the first page target.
async fn page_socket(port: u16) -> String {
    loop {
        let list: Value = serde_json::from_str(&get(port, "/json/list").await).unwrap_or_default();
        let page = list
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["type"] == "page")
            .and_then(|t| t["webSocketDebuggerUrl"].as_str());
        if let Some(url) = page {
            let path = url
                .split_once(&format!("127.0.0.1:{port}"))
                .expect("a local URL")
                .1;
            return path.to_owned();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The client side of the WebSocket opening handshake.
async fn upgrade(port: u16, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let head = head_of(&mut s).await;
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s
}

/// One masked text frame (a client must mask; any key will do).
async fn send(ws: &mut TcpStream, payload: &[u8]) {
    let key = [0x5a, 0x17, 0xc3, 0x9e];
    let mut frame = vec![0x81];
    match payload.len() {
        n if n < 126 => frame.push(0x80 | n as u8),
        n if n <= 0xffff => {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            frame.push(0x80 | 127);
            frame.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    frame.extend_from_slice(&key);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    ws.write_all(&frame).await.expect("send a frame");
}

/// One whole message (continuation frames joined; pings skipped).
async fn receive(ws: &mut TcpStream) -> Vec<u8> {
    let mut message = Vec::new();
    loop {
        let mut head = [0u8; 2];
        ws.read_exact(&mut head).await.expect("a frame");
        let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0f);
        let len = match head[1] & 0x7f {
            126 => u64::from(ws.read_u16().await.expect("length")),
            127 => ws.read_u64().await.expect("length"),
            n => u64::from(n),
        };
        assert!(len < 256 << 20, "a frame of {len} bytes");
        let mut payload = vec![0u8; len as usize];
        ws.read_exact(&mut payload).await.expect("payload");
        match opcode {
            0x8 => panic!("the browser closed the DevTools socket"),
            0x9 | 0xa => continue,
            _ => message.extend_from_slice(&payload),
        }
        if fin {
            return message;
        }
    }
}
