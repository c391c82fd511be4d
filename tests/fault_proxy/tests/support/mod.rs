//! A minimal HTTP/1.1 client over a plain socket, for what an S3 client hides: exact bytes on
//! the wire, a connection reused by hand, a client that leaves mid-body.
#![allow(dead_code)] // each test file uses a part

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response as read off the socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Whether the body had the announced Content-Length.
    pub complete: bool,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One keep-alive connection.
pub struct RawConn {
    reader: BufReader<TcpStream>,
    /// The `host:port` connected to, sent as the Host header: a presigned URL's signature
    /// covers it, and servers that check signatures (SeaweedFS) refuse any other.
    host: String,
}

impl RawConn {
    pub fn connect(addr: &str) -> Self {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        RawConn {
            reader: BufReader::new(s),
            host: addr.to_string(),
        }
    }

    pub fn stream(&mut self) -> &mut TcpStream {
        self.reader.get_mut()
    }

    /// Sends a request with a Content-Length body and reads the response.
    pub fn request(&mut self, method: &str, target: &str, body: &[u8]) -> RawResponse {
        self.send_head(method, target, body.len(), "");
        self.stream().write_all(body).unwrap();
        self.read_response(method == "HEAD")
    }

    /// Writes a request head announcing `len` body bytes, plus `extra` header lines.
    pub fn send_head(&mut self, method: &str, target: &str, len: usize, extra: &str) {
        let head = format!(
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nContent-Length: {len}\r\n{extra}\r\n",
            self.host
        );
        self.stream().write_all(head.as_bytes()).unwrap();
    }

    /// Reads one response; a body cut by the peer comes back with `complete: false`.
    pub fn read_response(&mut self, head_only: bool) -> RawResponse {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status line");
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line, got {line:?}"));
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            self.reader.read_line(&mut h).expect("header line");
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').expect("header has a colon");
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
        let mut resp = RawResponse {
            status,
            headers,
            body: Vec::new(),
            complete: true,
        };
        if head_only {
            return resp;
        }
        let len: usize = resp
            .header("content-length")
            .map(|v| v.parse().unwrap())
            .expect("responses in these tests carry Content-Length");
        let mut body = Vec::new();
        let _ = (&mut self.reader).take(len as u64).read_to_end(&mut body);
        resp.complete = body.len() == len;
        resp.body = body;
        resp
    }

    /// Whether the peer has closed the connection (EOF or reset on the next read).
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        !matches!(self.reader.read(&mut b), Ok(n) if n > 0)
    }
}

/// A throwaway connection for one request.
pub fn request(addr: &str, method: &str, target: &str, body: &[u8]) -> RawResponse {
    RawConn::connect(addr).request(method, target, body)
}
