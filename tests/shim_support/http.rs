//! A minimal HTTP/1.1 client over `std::net::TcpStream`, enough to talk to llama-server
//! on loopback: one request per connection (`Connection: close`, so the response ends
//! where the stream does), bodies by `Content-Length` or chunked. Every connect, write
//! and read is bounded by the caller's timeout, so a server that hangs fails the test
//! instead of stalling it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response: the status code and the body as text.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {}", self.body))
    }
}

/// `GET path`.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> io::Result<Response> {
    request(addr, "GET", path, None, timeout)
}

/// `POST path` with a JSON body.
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> io::Result<Response> {
    request(addr, "POST", path, Some(&body.to_string()), timeout)
}

/// One request on a fresh connection; `timeout` bounds the connect and each read and
/// write (a non-streamed completion arrives in one piece once generated, so the first
/// read waits for the whole generation).
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(request_bytes(addr, method, path, body).as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn request_bytes(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> String {
    let mut text = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(body) = body {
        text += &format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
    }
    text += "\r\n";
    text += body.unwrap_or("");
    text
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// Splits a whole response (the stream read to its end) into status and body.
fn parse_response(raw: &[u8]) -> io::Result<Response> {
    let head_end = raw
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .ok_or_else(|| invalid(format!("no end of headers in {} bytes", raw.len())))?;
    let head = String::from_utf8_lossy(&raw[..head_end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| invalid(format!("bad status line {status_line:?}")))?;
    let header = |name: &str| {
        lines.clone().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_string())
        })
    };
    let rest = &raw[head_end + 4..];
    let body = if header("transfer-encoding").is_some_and(|value| value.contains("chunked")) {
        dechunk(rest)?
    } else if let Some(length) = header("content-length") {
        let length: usize = length
            .parse()
            .map_err(|_| invalid(format!("bad Content-Length {length:?}")))?;
        rest.get(..length)
            .ok_or_else(|| invalid(format!("body of {} bytes, {length} announced", rest.len())))?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// The body of a chunked response: hex size lines, each followed by that many bytes.
fn dechunk(mut rest: &[u8]) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|window| window == b"\r\n")
            .ok_or_else(|| invalid("chunk size line without its end".into()))?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| invalid(format!("bad chunk size {size_text:?}")))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest
            .get(..size)
            .ok_or_else(|| invalid("a chunk cut short".into()))?;
        body.extend_from_slice(chunk);
        rest = rest.get(size + 2..).unwrap_or_default();
    }
}
