//! The membership messages members and tools exchange on an authenticated control link:
//! a request (`Gossip`, carried by `ToNode::Members`) and a node's answer (`MemberReply`).

use serde::{Deserialize, Serialize};

/// A member as members describe each other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub name: String,
    /// Control address, IP:PORT (an unspecified IP means "the address you reach me by").
    pub addr: String,
    #[serde(default)]
    pub version: u32,
    /// The instance id (`discovery::instance_id`); empty when not known yet.
    #[serde(default)]
    pub id: String,
}

/// A membership request: who asks (absent for a tool such as `weft cluster status`) and
/// the members it knows to be up.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Gossip {
    #[serde(default)]
    pub me: Option<MemberInfo>,
    #[serde(default)]
    pub known: Vec<MemberInfo>,
}

/// A node's answer: itself and the members it knows to be up.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberList {
    pub me: MemberInfo,
    #[serde(default)]
    pub members: Vec<MemberInfo>,
}

/// A node's answers on a member link. `Failed` has the shape of `FromNode::Failed`, so
/// a node that refuses the link as it would a coordinator is understood.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum MemberReply {
    Members(Box<MemberList>),
    Failed { error: String },
}
