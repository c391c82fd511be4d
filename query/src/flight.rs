//! A read-only Arrow Flight SQL server over a [`QuerySession`].
//!
//! Authentication: every call must carry `authorization: Bearer <token>`. A client that only
//! speaks the Flight handshake (user name and password, HTTP Basic) may send the token as the
//! password with any user name; the handshake answers with the bearer header to use.
//! Queries: `GetFlightInfo(CommandStatementQuery)` then `DoGet`, or prepared statements without
//! parameters. Statements that write or create anything are refused with `PERMISSION_DENIED`;
//! SQL errors come back as `INVALID_ARGUMENT` and the server keeps serving.
//!
//! Protection from one client: queries run through a [`QueryExecutor`] (a runtime of their
//! own, a bounded number at a time) under the session's [`crate::QueryLimits`] (a memory pool
//! per query, a deadline). A query past a limit comes back as `RESOURCE_EXHAUSTED` naming the
//! limit; a client that goes away stops its query.
use std::pin::Pin;
use std::sync::Arc;

use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, CommandGetCatalogs, CommandGetDbSchemas, CommandGetTables,
    CommandPreparedStatementQuery, CommandPreparedStatementUpdate, CommandStatementQuery,
    CommandStatementUpdate, ProstMessageExt, SqlInfo, TicketStatementQuery,
};
use arrow_flight::{
    FlightDescriptor, FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse, IpcMessage,
    SchemaAsIpc, Ticket,
};
use base64::Engine;
use datafusion::arrow::datatypes::Schema;
use datafusion::arrow::ipc::writer::IpcWriteOptions;
use futures::{Stream, TryStreamExt};
use prost::Message;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};

use crate::executor::QueryExecutor;
use crate::{QueryError, QuerySession};

/// A `do_get` response streaming one record batch (the catalog, schema and table listings).
fn one_batch(
    batch: datafusion::arrow::record_batch::RecordBatch,
) -> Response<<HslakeFlightSql as FlightService>::DoGetStream> {
    let stream = FlightDataEncoderBuilder::new()
        .with_schema(batch.schema())
        .build(futures::stream::iter([Ok(batch)]))
        .map_err(Status::from);
    Response::new(Box::pin(stream))
}

/// The Flight SQL service: a shared session, the executor running its queries and the
/// accepted token.
pub struct HslakeFlightSql {
    session: Arc<QuerySession>,
    executor: QueryExecutor,
    token: String,
}

impl HslakeFlightSql {
    /// A service answering queries on `session` through `executor` for clients presenting
    /// `token`.
    pub fn new(session: QuerySession, executor: QueryExecutor, token: String) -> Self {
        HslakeFlightSql {
            session: Arc::new(session),
            executor,
            token,
        }
    }

    /// Check the bearer token of a request.
    fn check_token<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let value = req.metadata().get("authorization").map(|v| v.as_bytes());
        check_bearer(value, &self.token).map_err(Status::unauthenticated)
    }

    /// Plan `sql` and return its result schema, mapping errors to statuses.
    async fn plan_schema(&self, sql: &str) -> Result<Schema, Status> {
        let df = self.session.sql(sql).await.map_err(to_status)?;
        Ok(df.schema().as_arrow().clone())
    }

    /// The answer to `GetFlightInfo` for a command that `do_get` answers with `schema`, after
    /// checking the caller's token.
    fn command_info(
        &self,
        schema: &Schema,
        ticket: Vec<u8>,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.check_token(&request)?;
        let info = self.flight_info(schema, ticket, request.into_inner())?;
        Ok(Response::new(info))
    }

    fn flight_info(
        &self,
        schema: &Schema,
        ticket: Vec<u8>,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo, Status> {
        let endpoint = FlightEndpoint::new().with_ticket(Ticket::new(ticket));
        Ok(FlightInfo::new()
            .try_with_schema(schema)
            .map_err(|e| Status::internal(format!("encoding the result schema: {e}")))?
            .with_endpoint(endpoint)
            .with_descriptor(descriptor))
    }

    /// Run `sql` through the executor and stream its batches as Flight data. Dropping the
    /// response (the client went away) drops the query stream, which stops the query.
    async fn stream(
        &self,
        sql: &str,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let batches = self
            .executor
            .run(self.session.clone(), sql.to_string())
            .await
            .map_err(to_status)?;
        let schema = batches.schema();
        let batches =
            batches.map_err(|e| FlightError::Tonic(Box::new(to_status(QueryError::from(e)))));
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches)
            .map_err(Status::from);
        Ok(Response::new(Box::pin(data)))
    }
}

/// Check the value of an `authorization` header against `token`: the one check of a bearer
/// token, for Flight SQL clients and for a coordinator calling a worker
/// ([`crate::distributed`]). The error says what was wrong and what was expected.
pub(crate) fn check_bearer(value: Option<&[u8]>, token: &str) -> Result<(), &'static str> {
    let Some(value) = value else {
        return Err("missing authorization header; expected \"Bearer <token>\"");
    };
    let value = std::str::from_utf8(value).map_err(|_| "authorization header is not text")?;
    match value.strip_prefix("Bearer ") {
        Some(t) if constant_time_eq(t.trim().as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err("invalid bearer token"),
        None => Err("authorization header is not \"Bearer <token>\""),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn to_status(e: QueryError) -> Status {
    match e {
        QueryError::ReadOnly { .. } => Status::permission_denied(e.to_string()),
        QueryError::Sql(_) => Status::invalid_argument(e.to_string()),
        QueryError::Limit { .. } | QueryError::TooComplex { .. } => {
            Status::resource_exhausted(e.to_string())
        }
        // A stored value that does not decode: the data is damaged, not the query.
        QueryError::BadValue(_) => Status::data_loss(e.to_string()),
        other => Status::internal(other.to_string()),
    }
}

/// The password of HTTP Basic credentials (`base64(user:password)`). Padding is optional:
/// RFC 7617 clients pad, but the ADBC Go driver sends unpadded base64, so a user name whose
/// credentials are not a multiple of three bytes long must not be refused.
fn basic_password(b64: &str) -> Result<String, Status> {
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let raw = engine.decode(b64.trim()).map_err(|e| {
        Status::unauthenticated(format!(
            "Basic credentials are not base64 ({e}); expected base64 of \"user:password\""
        ))
    })?;
    let raw = String::from_utf8(raw)
        .map_err(|_| Status::unauthenticated("Basic credentials are not UTF-8 text"))?;
    match raw.split_once(':') {
        Some((_, password)) => Ok(password.to_string()),
        None => Err(Status::unauthenticated(
            "Basic credentials have no ':'; expected base64 of \"user:password\"",
        )),
    }
}

/// Characters of a statement's text a log line shows.
const LOGGED_SQL_CHARS: usize = 200;

/// `sql` as a log line shows it: its first [`LOGGED_SQL_CHARS`] characters and its size. A
/// client may send 256 KiB statements many times a second, and a log written to a pipe nobody
/// drains blocks the tokio worker writing it: the whole server then stops answering.
fn logged_sql(sql: &str) -> String {
    match sql.char_indices().nth(LOGGED_SQL_CHARS) {
        None => sql.to_string(),
        Some((end, _)) => format!("{}… ({} bytes in all)", &sql[..end], sql.len()),
    }
}

fn refuse_write() -> Status {
    Status::permission_denied("refused: SQL over hslake datasets is read-only")
}

#[tonic::async_trait]
impl FlightSqlService for HslakeFlightSql {
    type FlightService = HslakeFlightSql;

    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<
        Response<Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>>,
        Status,
    > {
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                Status::unauthenticated("handshake needs an authorization header (Basic or Bearer)")
            })?;
        let token_ok = if let Some(b64) = header.strip_prefix("Basic ") {
            let password = basic_password(b64)?;
            constant_time_eq(password.as_bytes(), self.token.as_bytes())
        } else if let Some(t) = header.strip_prefix("Bearer ") {
            constant_time_eq(t.trim().as_bytes(), self.token.as_bytes())
        } else {
            false
        };
        if !token_ok {
            return Err(Status::unauthenticated(
                "invalid credentials: expected the server's token",
            ));
        }
        let response = HandshakeResponse {
            protocol_version: 0,
            payload: self.token.clone().into(),
        };
        let mut resp: Response<
            Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>,
        > = Response::new(Box::pin(futures::stream::iter([Ok(response)])));
        let bearer = MetadataValue::try_from(format!("Bearer {}", self.token))
            .map_err(|_| Status::internal("token is not a valid header value"))?;
        resp.metadata_mut().insert("authorization", bearer);
        Ok(resp)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.check_token(&request)?;
        tracing::info!(sql = %logged_sql(&query.query), "flight sql query");
        let schema = self.plan_schema(&query.query).await?;
        let ticket = TicketStatementQuery {
            statement_handle: query.query.into_bytes().into(),
        };
        let info = self.flight_info(
            &schema,
            ticket.as_any().encode_to_vec(),
            request.into_inner(),
        )?;
        Ok(Response::new(info))
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.check_token(&request)?;
        let sql = String::from_utf8(ticket.statement_handle.to_vec())
            .map_err(|_| Status::invalid_argument("statement handle is not UTF-8 SQL"))?;
        self.stream(&sql).await
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        request: Request<arrow_flight::Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        self.check_token(&request)?;
        tracing::info!(sql = %logged_sql(&query.query), "flight sql prepare");
        let schema = self.plan_schema(&query.query).await?;
        let IpcMessage(schema_bytes) = SchemaAsIpc::new(&schema, &IpcWriteOptions::default())
            .try_into()
            .map_err(|e: datafusion::arrow::error::ArrowError| {
                Status::internal(format!("encoding the schema: {e}"))
            })?;
        // The handle is the SQL itself: the server keeps no per-statement state.
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: query.query.into_bytes().into(),
            dataset_schema: schema_bytes,
            parameter_schema: Default::default(),
        })
    }

    async fn do_action_close_prepared_statement(
        &self,
        _query: ActionClosePreparedStatementRequest,
        request: Request<arrow_flight::Action>,
    ) -> Result<(), Status> {
        self.check_token(&request)?;
        Ok(())
    }

    async fn get_flight_info_prepared_statement(
        &self,
        cmd: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.check_token(&request)?;
        let sql = String::from_utf8(cmd.prepared_statement_handle.to_vec())
            .map_err(|_| Status::invalid_argument("prepared statement handle is not UTF-8 SQL"))?;
        let schema = self.plan_schema(&sql).await?;
        let info = self.flight_info(&schema, cmd.as_any().encode_to_vec(), request.into_inner())?;
        Ok(Response::new(info))
    }

    async fn do_get_prepared_statement(
        &self,
        cmd: CommandPreparedStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.check_token(&request)?;
        let sql = String::from_utf8(cmd.prepared_statement_handle.to_vec())
            .map_err(|_| Status::invalid_argument("prepared statement handle is not UTF-8 SQL"))?;
        self.stream(&sql).await
    }

    async fn do_put_prepared_statement_query(
        &self,
        cmd: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<arrow_flight::sql::DoPutPreparedStatementResult, Status> {
        // Clients bind (empty) parameters before executing; the statement takes none, so the
        // handle comes back unchanged.
        self.check_token(&request)?;
        Ok(arrow_flight::sql::DoPutPreparedStatementResult {
            prepared_statement_handle: Some(cmd.prepared_statement_handle),
        })
    }

    async fn do_put_statement_update(
        &self,
        _cmd: CommandStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        self.check_token(&request)?;
        Err(refuse_write())
    }

    async fn do_put_prepared_statement_update(
        &self,
        _cmd: CommandPreparedStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        self.check_token(&request)?;
        Err(refuse_write())
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        self.command_info(&schema, query.as_any().encode_to_vec(), request)
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.check_token(&request)?;
        let mut b = query.into_builder();
        for c in self.session.context().catalog_names() {
            b.append(c);
        }
        Ok(one_batch(b.build().map_err(Status::from)?))
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        self.command_info(&schema, query.as_any().encode_to_vec(), request)
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.check_token(&request)?;
        let ctx = self.session.context();
        let mut b = query.into_builder();
        for c in ctx.catalog_names() {
            if let Some(cat) = ctx.catalog(&c) {
                for s in cat.schema_names() {
                    b.append(&c, s);
                }
            }
        }
        Ok(one_batch(b.build().map_err(Status::from)?))
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        self.command_info(&schema, query.as_any().encode_to_vec(), request)
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.check_token(&request)?;
        let ctx = self.session.context();
        let mut b = query.into_builder();
        for c in ctx.catalog_names() {
            let Some(cat) = ctx.catalog(&c) else { continue };
            for s in cat.schema_names() {
                let Some(sp) = cat.schema(&s) else { continue };
                for t in sp.table_names() {
                    if let Ok(Some(table)) = sp.table(&t).await {
                        b.append(&c, &s, &t, "TABLE", &table.schema())
                            .map_err(Status::from)?;
                    }
                }
            }
        }
        Ok(one_batch(b.build().map_err(Status::from)?))
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

/// `service` as the gRPC service a tonic server adds, with its message size limits (for a
/// server built with its own connection settings, as `hslake serve-sql` builds one).
pub fn flight_service(service: HslakeFlightSql) -> FlightServiceServer<HslakeFlightSql> {
    FlightServiceServer::new(service)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(256 << 20)
}

/// Serve `service` on an already bound listener until `shutdown` resolves (binding first lets
/// callers bind port 0 and learn the port).
pub async fn serve_listener(
    service: HslakeFlightSql,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let service = flight_service(service);
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_flight::sql::client::FlightSqlServiceClient;

    #[test]
    fn a_long_statement_is_logged_as_its_head_and_its_size() {
        assert_eq!(logged_sql("SELECT 1"), "SELECT 1");
        let long = format!("SELECT 'é'{}", "||'é'".repeat(3000));
        let logged = logged_sql(&long);
        let head: String = long.chars().take(LOGGED_SQL_CHARS).collect();
        assert_eq!(logged, format!("{head}… (18011 bytes in all)"));
    }

    #[test]
    fn a_corrupt_stored_value_is_data_loss_naming_its_place() {
        let bad = crate::BadTensorValue {
            function: "tensor_norm".into(),
            file: Some("s3://b/ds/data/a.parquet".into()),
            row_group: Some(2),
            row: Some(5),
            sample_id: Some(17),
            column: "layer_3".into(),
            reason: "corrupt value: plane 2: content differs from the frame's checksum".into(),
        };
        let st = to_status(QueryError::BadValue(Box::new(bad)));
        assert_eq!(st.code(), tonic::Code::DataLoss);
        assert_eq!(
            st.message(),
            "tensor_norm: s3://b/ds/data/a.parquet: row group 2: row 5 (sample 17) layer_3: \
             corrupt value: plane 2: content differs from the frame's checksum"
        );
    }
    use futures::StreamExt;
    use hslake_schemas::DType;

    use crate::executor::ExecutorLimits;
    use crate::QueryLimits;

    /// Runs until stopped: a cross join with a practically endless stream of rows, holding
    /// little memory (6 build rows) and producing no batch before it ends.
    const ENDLESS: &str = "SELECT sum(tensor_norm(a.layer_2)) FROM tiny.samples a CROSS JOIN generate_series(1, 1000000000000) g";

    async fn start(token: &str) -> (String, tokio::sync::oneshot::Sender<()>) {
        start_with(token, QueryLimits::default(), ExecutorLimits::for_machine()).await
    }

    /// A server over a 6-sample dataset (schema `tiny`) with the given limits.
    async fn start_with(
        token: &str,
        limits: QueryLimits,
        executor: ExecutorLimits,
    ) -> (String, tokio::sync::oneshot::Sender<()>) {
        // Tests run in parallel in one process: each server gets a dataset of its own.
        let url = format!("memory://flight-test-{}", next_test());
        let ds = crate::testdata::write(&url, DType::Bf16, 6, 1).await;
        start_on(&ds, "tiny", token, limits, executor).await
    }

    fn next_test() -> usize {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// A server over `ds` (schema `name`) with the given limits.
    async fn start_on(
        ds: &hslake_store::Dataset,
        name: &str,
        token: &str,
        limits: QueryLimits,
        executor: ExecutorLimits,
    ) -> (String, tokio::sync::oneshot::Sender<()>) {
        let mut session = QuerySession::new().unwrap();
        session.set_limits(limits);
        session.add_dataset(Some(name), ds, None).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let service = HslakeFlightSql::new(
            session,
            QueryExecutor::new(executor).unwrap(),
            token.to_string(),
        );
        tokio::spawn(async move {
            serve_listener(service, listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        (format!("http://{addr}"), tx)
    }

    async fn client(url: &str, token: &str) -> FlightSqlServiceClient<tonic::transport::Channel> {
        let channel = tonic::transport::Endpoint::from_shared(url.to_string())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = FlightSqlServiceClient::new(channel);
        c.set_token(token.to_string());
        c
    }

    async fn run(
        c: &mut FlightSqlServiceClient<tonic::transport::Channel>,
        sql: &str,
    ) -> Result<usize, String> {
        let info = c
            .execute(sql.to_string(), None)
            .await
            .map_err(|e| e.to_string())?;
        let mut rows = 0;
        for ep in info.endpoint {
            let mut s = c
                .do_get(ep.ticket.unwrap())
                .await
                .map_err(|e| e.to_string())?;
            while let Some(b) = s.next().await {
                rows += b.map_err(|e| e.to_string())?.num_rows();
            }
        }
        Ok(rows)
    }

    #[tokio::test]
    async fn serves_queries_refuses_writes_and_bad_tokens_and_keeps_serving() {
        let (url, stop) = start("s3cret").await;
        let mut good = client(&url, "s3cret").await;
        assert_eq!(
            run(
                &mut good,
                "SELECT sample_id, tensor_norm(layer_2) FROM tiny.samples"
            )
            .await
            .unwrap(),
            6
        );

        let mut bad = client(&url, "wrong").await;
        let e = run(&mut bad, "SELECT 1").await.unwrap_err();
        assert!(e.contains("invalid bearer token"), "{e}");

        let e = run(&mut good, "CREATE TABLE t AS SELECT 1")
            .await
            .unwrap_err();
        assert!(e.contains("read-only"), "{e}");
        let e = run(&mut good, "SELECT tensor_norm(seq_len) FROM tiny.samples")
            .await
            .unwrap_err();
        assert!(
            e.contains("tensor_norm: argument 1 (seq_len) is UInt32"),
            "{e}"
        );
        let e = run(&mut good, "SELECT nope FROM tiny.samples")
            .await
            .unwrap_err();
        assert!(e.contains("nope"), "{e}");

        assert_eq!(
            run(&mut good, "SELECT count(*) FROM tiny.samples")
                .await
                .unwrap(),
            1
        );
        let _ = stop.send(());
    }

    #[test]
    fn basic_credentials_decode_with_and_without_padding() {
        use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
        // User names of every length mod 3 give credentials with 0, 1 and 2 padding bytes.
        for user in ["a", "ab", "abc", "abcd", "abcde", "abcdef"] {
            let creds = format!("{user}:t0ken");
            for encoded in [STANDARD.encode(&creds), STANDARD_NO_PAD.encode(&creds)] {
                assert_eq!(basic_password(&encoded).unwrap(), "t0ken", "{encoded}");
            }
        }
        let e = basic_password("not base64!").unwrap_err();
        assert!(e.message().contains("not base64"), "{e}");
        let e = basic_password(&STANDARD.encode("no-colon")).unwrap_err();
        assert!(e.message().contains("no ':'"), "{e}");
    }

    #[tokio::test]
    async fn handshake_accepts_unpadded_basic_credentials() {
        let (url, stop) = start("s3cret").await;
        for user in ["abc", "abcd", "abcde"] {
            let channel = tonic::transport::Endpoint::from_shared(url.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            // The arrow-rs client pads; send what the ADBC Go driver sends instead.
            let unpadded =
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(format!("{user}:s3cret"));
            let mut req = tonic::Request::new(futures::stream::iter([HandshakeRequest::default()]));
            req.metadata_mut().insert(
                "authorization",
                format!("Basic {unpadded}").parse().unwrap(),
            );
            let mut raw =
                arrow_flight::flight_service_client::FlightServiceClient::new(channel.clone());
            let resp = raw.handshake(req).await.unwrap();
            let bearer = resp.metadata().get("authorization").unwrap();
            let bearer = bearer.to_str().unwrap().trim_start_matches("Bearer ");
            let mut c = FlightSqlServiceClient::new(channel);
            c.set_token(bearer.to_string());
            assert_eq!(run(&mut c, "SELECT 1").await.unwrap(), 1, "user {user}");
        }
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn a_query_past_the_memory_limit_is_refused_naming_it_and_the_server_keeps_serving() {
        let limits = QueryLimits {
            memory_per_query: Some(1 << 20),
            ..QueryLimits::default()
        };
        let (url, stop) = start_with("t", limits, ExecutorLimits::for_machine()).await;
        let mut c = client(&url, "t").await;
        // 600,000 tensors collected into one list: far more than 1 MiB.
        let e = run(
            &mut c,
            "SELECT array_agg(a.layer_2) FROM tiny.samples a CROSS JOIN generate_series(1, 100000) g",
        )
        .await
        .unwrap_err();
        assert!(
            e.contains("ResourceExhausted") || e.contains("resource"),
            "{e}"
        );
        assert!(e.contains("more memory than one query may use"), "{e}");
        assert!(
            e.contains("1024.0 KB per query, set by --query-memory"),
            "{e}"
        );
        assert_eq!(
            run(&mut c, "SELECT sample_id FROM tiny.samples")
                .await
                .unwrap(),
            6
        );
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn a_query_past_the_time_limit_is_stopped_naming_it() {
        let limits = QueryLimits {
            timeout: Some(std::time::Duration::from_millis(300)),
            ..QueryLimits::default()
        };
        let (url, stop) = start_with("t", limits, ExecutorLimits::for_machine()).await;
        let mut c = client(&url, "t").await;
        let e = run(&mut c, ENDLESS).await.unwrap_err();
        assert!(e.contains("ran longer than one query may run"), "{e}");
        assert!(e.contains("0.3 s, set by --query-timeout"), "{e}");
        assert_eq!(
            run(&mut c, "SELECT sample_id FROM tiny.samples")
                .await
                .unwrap(),
            6
        );
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn a_query_beyond_the_concurrency_limit_is_refused_naming_it() {
        let executor = ExecutorLimits {
            max_queries: 1,
            queue_timeout: std::time::Duration::from_millis(200),
            threads: 1,
        };
        let (url, stop) = start_with("t", QueryLimits::default(), executor).await;
        let mut holder = client(&url, "t").await;
        let info = holder.execute(ENDLESS.to_string(), None).await.unwrap();
        let ticket = info.endpoint[0].ticket.clone().unwrap();
        // The endless query holds the only slot as long as its stream is open.
        let _held = holder.do_get(ticket).await.unwrap();
        let mut c = client(&url, "t").await;
        let e = run(&mut c, "SELECT 1").await.unwrap_err();
        assert!(e.contains("query refused"), "{e}");
        assert!(e.contains("1 at once, set by --max-queries"), "{e}");
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn a_client_that_goes_away_frees_its_slot_for_the_next_one() {
        // One slot and a queue that waits a minute: the second query gets an answer only if
        // dropping the first one's stream stopped it. Without cancellation it would wait the
        // full minute and fail.
        let executor = ExecutorLimits {
            max_queries: 1,
            queue_timeout: std::time::Duration::from_secs(60),
            threads: 1,
        };
        let (url, stop) = start_with("t", QueryLimits::default(), executor).await;
        for _ in 0..3 {
            let mut gone = client(&url, "t").await;
            let info = gone.execute(ENDLESS.to_string(), None).await.unwrap();
            let stream = gone
                .do_get(info.endpoint[0].ticket.clone().unwrap())
                .await
                .unwrap();
            drop(stream);
            drop(gone);
        }
        let mut c = client(&url, "t").await;
        let started = std::time::Instant::now();
        assert_eq!(
            run(&mut c, "SELECT sample_id FROM tiny.samples")
                .await
                .unwrap(),
            6
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(60));
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn concurrent_scalar_functions_past_the_limits_are_refused_and_the_server_lives() {
        // 32 samples of 64 x 256 bf16 values: the cross join's concat would build 1024
        // values of about twice a stored value (tens of KB) each, more than the query's 1 MiB.
        // (Were concat not refused, `length` would fail next: these bytes are not text.)
        let url = format!("memory://flight-test-{}", next_test());
        let ds = crate::testdata::write_wide(&url, 32, 64, 256).await;
        let limits = QueryLimits {
            memory_per_query: Some(1 << 20),
            ..QueryLimits::default()
        };
        let (url, stop) = start_on(&ds, "big", "t", limits, ExecutorLimits::for_machine()).await;
        let (mut c1, mut c2) = (client(&url, "t").await, client(&url, "t").await);

        let concat =
            "SELECT max(length(concat(a.layer_1, b.layer_1))) FROM big.samples a, big.samples b";
        let (e1, e2) = tokio::join!(run(&mut c1, concat), run(&mut c2, concat));
        for e in [e1.unwrap_err(), e2.unwrap_err()] {
            assert!(e.contains("resource has been exhausted"), "{e}");
            assert!(
                e.contains("needs more memory than one query may use (limit: 1024.0 KB per query, set by --query-memory)"),
                "{e}"
            );
            assert!(e.contains("for concat"), "{e}");
        }

        let repeat = "SELECT repeat('x', 2147483647)";
        let (e1, e2) = tokio::join!(run(&mut c1, repeat), run(&mut c2, repeat));
        for e in [e1.unwrap_err(), e2.unwrap_err()] {
            assert!(e.contains("resource has been exhausted"), "{e}");
            assert!(
                // Refused as a constant while it is folded, before execution.
                e.contains(
                    "repeat would build a constant of 2.0 GB, which DataFusion copies into each \
                     row of a batch (up to 1 rows); at most 256.0 KB is allowed (limit: 256.0 KB \
                     per value, set by --max-value-size)"
                ),
                "{e}"
            );
        }
        assert_eq!(
            run(&mut c1, "SELECT sample_id FROM big.samples")
                .await
                .unwrap(),
            32
        );
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn a_dropped_client_stream_cancels_its_query_mid_batch_within_a_second() {
        // One slot, one query thread and a queue that waits one second: the light query is
        // answered only if dropping the heavy one's stream freed the slot within that second.
        // Each 8192-row batch of the heavy query decodes 8192 values of 64 x 256 elements,
        // seconds of work in a debug build, and DataFusion yields only between batches: the
        // query must stop between rows.
        let url = format!("memory://flight-test-{}", next_test());
        let ds = crate::testdata::write_wide(&url, 1, 64, 256).await;
        let executor = ExecutorLimits {
            max_queries: 1,
            queue_timeout: std::time::Duration::from_secs(1),
            threads: 1,
        };
        let (url, stop) = start_on(&ds, "big", "t", QueryLimits::default(), executor).await;
        let heavy = "SELECT sum(tensor_norm(a.layer_1)) FROM big.samples a CROSS JOIN generate_series(1, 1000000000) g";
        for _ in 0..2 {
            let mut gone = client(&url, "t").await;
            let info = gone.execute(heavy.to_string(), None).await.unwrap();
            let stream = gone
                .do_get(info.endpoint[0].ticket.clone().unwrap())
                .await
                .unwrap();
            // Inside the first batch by now.
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            drop(stream);
            drop(gone);
            let mut c = client(&url, "t").await;
            let started = std::time::Instant::now();
            assert_eq!(
                run(&mut c, "SELECT sample_id FROM big.samples")
                    .await
                    .unwrap(),
                1
            );
            assert!(started.elapsed() < std::time::Duration::from_secs(2));
        }
        let _ = stop.send(());
    }
}
