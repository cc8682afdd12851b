//! The control listener's HTTP pieces, shared by its two routers — the
//! sandbox routes (`admin.rs`) and the machine egress routes
//! (`machine/api.rs`) — so that neither borrows from the other. They are
//! the contract crate's ([`egress_api`]); only the body reader is bound here
//! to the control listener's cap.

use http::Request;
use hyper::body::Incoming;

pub(crate) use egress_api::body::MAX_BODY;
pub(crate) use egress_api::reply::{error, json_reply, Reply};

/// Reads a body of at most [`MAX_BODY`] bytes of UTF-8 (`413` beyond, `400` otherwise).
pub(crate) async fn body_text(req: Request<Incoming>) -> Result<String, Reply> {
    egress_api::body::text(req.into_body(), MAX_BODY).await
}
